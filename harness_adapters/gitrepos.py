"""Git on the host, safe to point at files an agent wrote: mirrors, checkouts, an agent's patch.

Owns every git command the appliance itself runs for coding tasks: finding a repository's
mirror (``<repos_dir>/<owner>__<name>.git``, SWE-bench's naming), checking a commit out for one
rollout, turning a working tree into a patch against a commit, and applying a patch. It knows
nothing about tasks, tests or rewards (``swebench.py`` decides what to check out and what to
keep of a patch).

A checkout borrows the mirror's objects (``objects/info/alternates``, what ``git clone
--shared`` does) instead of copying them, so it costs the files of one commit, not the
history. It is made with ``git init`` + the alternates file rather than ``clone --shared``
so that it has no refs but its detached ``HEAD``: ``git log --all`` in it cannot show the
commits after ``base_commit`` (the upstream fix). Each checkout is its own repository, so any
number of rollouts can make theirs at once, and nothing an agent does in its ``.git`` reaches
the mirror or another rollout (unlike ``git worktree``, whose worktrees share the mirror's
config and refs). The mirror must not be repacked with ``-a -d`` or pruned while rollouts run.

Safety: a working tree an agent wrote is only ever read with OUR git directory
(``--git-dir``): git never reads the agent's ``.git`` (its config, hooks, refs) that way, and
``add``/``diff``/``apply`` run no hooks. Every command also gets ``core.hooksPath=/dev/null``,
``core.fsmonitor=false``, ``diff.external=`` with ``--no-ext-diff --no-textconv``, no system or
global config (``GIT_CONFIG_NOSYSTEM``, ``GIT_CONFIG_GLOBAL=/dev/null``), no prompts, and
literal pathspecs; filter drivers and textconv need config we never write, so a
``.gitattributes`` in the agent's tree names commands that do not exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from contracts.errors import ConfigError
from harness_adapters.base import InfraError

OWNER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
COMMIT = re.compile(r"[0-9a-fA-F]{7,64}\Z")
#: ``-c`` settings of every git command here: nothing configurable may run a command.
SAFE_CONFIG = (
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.untrackedCache=false",
    "diff.external=",
    "core.pager=cat",
    "core.askPass=",
    "credential.helper=",
    "advice.detachedHead=false",
)


class GitTimeout(InfraError):
    """A git command ran past its time limit."""


class TreeError(Exception):
    """An agent's working tree could not be read as a patch (unreadable files, too many or too
    big to hash in time): the agent's doing, so the verifier scores it 0.0, not a failure."""


def git_env(*, index: Path | None = None) -> dict[str, str]:
    """A clean environment for git: no inherited ``GIT_*``, no system or global config."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LC_ALL": "C",
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_LITERAL_PATHSPECS": "1",
        "GIT_OPTIONAL_LOCKS": "0",
    }
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return env


def git(
    args: Sequence[str],
    *,
    git_dir: Path | None = None,
    work_tree: Path | None = None,
    cwd: Path | None = None,
    index: Path | None = None,
    timeout_s: float = 600.0,
    stdout: Path | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git <args>`` (blocking) with the safe settings; never raises for its exit code."""
    argv = ["git"]
    for setting in SAFE_CONFIG:
        argv += ["-c", setting]
    if git_dir is not None:
        argv.append(f"--git-dir={git_dir}")
    if work_tree is not None:
        argv.append(f"--work-tree={work_tree}")
    argv += args
    try:
        if stdout is None:
            return subprocess.run(
                argv, cwd=cwd, env=git_env(index=index), capture_output=True, timeout=timeout_s, check=False
            )
        with stdout.open("wb") as out:
            return subprocess.run(
                argv,
                cwd=cwd,
                env=git_env(index=index),
                stdout=out,
                stderr=subprocess.PIPE,
                timeout=timeout_s,
                check=False,
            )
    except subprocess.TimeoutExpired:
        raise GitTimeout(f"git {args[0]} ran past {timeout_s:g} s") from None
    except FileNotFoundError:
        if cwd is not None and not cwd.is_dir():
            raise InfraError(f"{str(cwd)!r} is not a directory") from None
        raise InfraError("git is not installed (it is needed to check out coding tasks)") from None


def _stderr(result: subprocess.CompletedProcess[bytes]) -> str:
    lines = result.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def mirror_path(repos_dir: Path, repo: str) -> Path:
    """The git directory of ``owner/name``'s mirror: ``owner__name.git`` (bare), else a clone
    ``owner__name/.git``; ``ConfigError`` naming the expected path if neither exists."""
    if not OWNER_NAME.match(repo) or ".." in repo:
        raise ConfigError(f"repo {repo!r} is not owner/name")
    stem = repo.replace("/", "__")
    bare, clone = repos_dir / f"{stem}.git", repos_dir / stem / ".git"
    for candidate in (bare, clone):
        if (candidate / "objects").is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"no mirror of {repo} in {str(repos_dir)!r}: expected {str(bare)!r} "
        f"(git clone --mirror https://github.com/{repo} {bare})"
    )


def resolve_commit(mirror: Path, commit: str) -> str:
    """``commit``'s full id in the mirror; ``ConfigError`` if it is not there."""
    if not COMMIT.match(commit):
        raise ConfigError(f"{commit!r} is not a commit id (hex)")
    result = git(
        ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}"], git_dir=mirror
    )
    if result.returncode != 0:
        raise ConfigError(
            f"commit {commit} is not in the mirror {str(mirror)!r} (fetch it: git -C {mirror} fetch)"
        )
    return result.stdout.decode().strip()


def stores_dir() -> Path:
    """Where the commits' own object stores are kept (``commit_store``): this user's, owner-only."""
    return Path(tempfile.gettempdir()) / f"lightning-appliance-commits-{os.getuid()}"


def commit_store(mirror: Path, commit: str) -> Path:
    """A bare repository holding ``commit``'s objects and nothing else (a depth-1 fetch from the
    mirror), made once per mirror and commit and shared by every rollout of it (blocking).

    A checkout borrows its objects from here, not from the mirror: the mirror holds the
    repository's later history, the fix among it, which an agent could read in the objects a
    checkout borrows (``git cat-file --batch-all-objects``)."""
    full = resolve_commit(mirror, commit)
    root = stores_dir()
    root.mkdir(mode=0o700, exist_ok=True)
    store = root / f"{mirror.name.removesuffix('.git')}-{full}.git"
    if (store / "shallow").is_file():
        return store
    scratch = Path(tempfile.mkdtemp(prefix=".making-", dir=root))
    try:
        made = git(["init", "--quiet", "--bare", "--template=", str(scratch)])
        if made.returncode == 0:
            made = git(["fetch", "--quiet", "--depth=1", f"file://{mirror.resolve()}", full], git_dir=scratch)
        if made.returncode != 0:
            raise InfraError(f"could not take commit {full[:12]} out of {str(mirror)!r}: {_stderr(made)}")
        try:
            scratch.rename(store)  # whole or not at all; a rollout beside this one may win
        except OSError:
            if not (store / "shallow").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return store


def checkout(mirror: Path, commit: str, dest: Path) -> None:
    """The files of ``commit`` in ``dest`` (absent or empty), with a ``.git`` that borrows the
    objects of the commit alone (``commit_store``) and whose only ref is the detached ``HEAD``
    (blocking)."""
    full = resolve_commit(mirror, commit)
    store = commit_store(mirror, full)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise InfraError(f"cannot check out into {str(dest)!r}: it is not empty")
    result = git(["init", "--quiet", "--template=", str(dest)])
    if result.returncode != 0:
        raise InfraError(f"git init {str(dest)!r}: {_stderr(result)}")
    (dest / ".git" / "objects" / "info").mkdir(parents=True, exist_ok=True)
    (dest / ".git" / "objects" / "info" / "alternates").write_text(f"{store / 'objects'}\n")
    shutil.copyfile(store / "shallow", dest / ".git" / "shallow")  # its history ends here
    result = git(["checkout", "--quiet", "--detach", full], git_dir=dest / ".git", work_tree=dest, cwd=dest)
    if result.returncode != 0:
        raise InfraError(f"git checkout {full[:12]} into {str(dest)!r}: {_stderr(result)}")


def changed_paths(git_dir: Path, work_tree: Path, base: str, index: Path, timeout_s: float) -> list[str]:
    """Stage ``work_tree`` as it is into a fresh ``index`` (starting from ``base``), with OUR
    ``git_dir``: the paths that differ from ``base`` (added, changed, deleted; no renames)."""
    if work_tree.is_symlink() or not work_tree.is_dir():
        raise TreeError(f"the agent's working directory {str(work_tree)!r} is not a directory")
    for args in (["read-tree", base], ["add", "--all", "--", "."]):
        try:
            result = git(
                args, git_dir=git_dir, work_tree=work_tree, cwd=work_tree, index=index, timeout_s=timeout_s
            )
        except GitTimeout as exc:
            raise TreeError(f"reading the agent's working tree: {exc}") from None
        if result.returncode != 0:
            raise TreeError(f"git {args[0]} of the agent's working tree: {_stderr(result)}")
    result = git(
        ["diff", "--cached", "--name-only", "-z", "--no-renames", "--no-ext-diff", base],
        git_dir=git_dir,
        index=index,
        timeout_s=timeout_s,
    )
    if result.returncode != 0:
        raise InfraError(f"git diff --name-only: {_stderr(result)}")
    return [os.fsdecode(p) for p in result.stdout.split(b"\0") if p]


def write_patch(
    git_dir: Path, base: str, index: Path, patch: Path, *, unstage: Sequence[str], timeout_s: float
) -> None:
    """Write the staged changes of ``index`` against ``base`` to ``patch``, after putting the
    paths in ``unstage`` back as they are in ``base`` (binary-safe, no renames)."""
    if unstage:
        spec = patch.with_suffix(".unstage")
        spec.write_bytes(b"".join(os.fsencode(p) + b"\0" for p in unstage))
        result = git(
            ["reset", "--quiet", f"--pathspec-from-file={spec}", "--pathspec-file-nul", base],
            git_dir=git_dir,
            index=index,
            timeout_s=timeout_s,
        )
        if result.returncode != 0:
            raise InfraError(f"git reset of the dropped files: {_stderr(result)}")
    args = ["diff", "--cached", "--binary", "--full-index", "--no-renames", "--no-ext-diff", "--no-textconv"]
    result = git([*args, base], git_dir=git_dir, index=index, timeout_s=timeout_s, stdout=patch)
    if result.returncode != 0:
        raise InfraError(f"git diff of the agent's changes: {_stderr(result)}")


def apply_patch(repo: Path, patch: Path, *, timeout_s: float = 120.0) -> str | None:
    """Apply ``patch`` to the working tree of ``repo`` (ours); None, or why it did not apply.
    ``git apply`` refuses paths outside the tree, inside ``.git`` and beyond a symlink."""
    if patch.stat().st_size == 0:
        return None
    result = git(
        ["apply", "--whitespace=nowarn", str(patch)],
        git_dir=repo / ".git",
        work_tree=repo,
        cwd=repo,
        timeout_s=timeout_s,
    )
    if result.returncode != 0:
        return result.stderr.decode(errors="replace").strip() or f"git apply: exit status {result.returncode}"
    return None

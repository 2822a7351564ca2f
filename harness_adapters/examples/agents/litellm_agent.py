"""An agent on ``litellm``: one ``completion`` call through its ``openai/`` route.

Run as ``python -m harness_adapters.examples.agents.litellm_agent --model openai/M "question"``.
litellm's ``openai/`` route reads ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` and
``OPENAI_API_KEY`` (the rollout's endpoint). Offline: ``LITELLM_LOCAL_MODEL_COST_MAP=True``
(set by the config) keeps it from downloading its model cost map at import. The answer goes to
``answer.txt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import litellm

SYSTEM = "You are a careful calculator. Reply with only the number."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a litellm model name, e.g. openai/<served model>")
    parser.add_argument("question")
    args = parser.parse_args()
    reply = litellm.completion(
        model=args.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": args.question}],
        num_retries=2,
    )
    Path("answer.txt").write_text(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()

"""Operations: what a person running the appliance checks, keeps and watches around a run.

Owns the checks before a start (``preflight``: a refused start answers before torch loads), the
machine report (``doctor`` over ``doctor_facts``), backups of a run directory (``backup``), the
health conditions ``/healthz`` answers with (``health``) and the garbage collector's settings
while serving (``collector``).

May import: ``appliance.config``, ``appliance.placement`` (what a plan needs of the machine),
``appliance.engines`` (model names, the vLLM interpreter), ``store`` and ``contracts``. The
composition root, the proxy, the scheduler (health) and the command line import it.
"""

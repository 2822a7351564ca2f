"""The ``lightning-appliance`` command line: one module per subcommand.

``entry`` parses the arguments, hands them to the subcommand's module (``up``, ``eval``
(``evaluate``), ``status``, ``tui``, ``backup``, ``export``, ``doctor``, ``plan``: each adds its
flags and runs), and turns an error a person can fix into one line and exit status 2;
``common`` holds what several subcommands share (flags, the event loop, the hard exit, reward
and loss text); ``config_flags`` a flag for every config field, grouped by section (``up``'s);
``stopper`` what the signals do while ``up`` runs. A subcommand module imports
``common`` and never another subcommand's module. The command line sits on top of everything:
it may import any of the appliance's modules and the packages below (``tui``, ``trainer``,
``store``, ``contracts``), the heavy ones (the appliance, torch, the dashboard) only inside the
command that needs them, so a refused start answers before torch is imported. Nothing imports
the command line back.

The package's public face is ``main``, the console script's entry point.
"""

from appliance.cli.entry import main

__all__ = ["main"]

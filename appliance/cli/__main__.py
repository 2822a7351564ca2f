"""``python -m appliance.cli``: the ``lightning-appliance`` command."""

import sys

from appliance.cli.entry import main

sys.exit(main())

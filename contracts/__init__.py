"""What every package of the project shares and none of them owns: the bottom layer.

``errors`` is the error hierarchy (each error's HTTP status, OpenAI ``type``/``code`` and its
body in both wire dialects), so the store, the trainer, the harness adapters and the dashboard
can raise errors the appliance answers with, without importing the appliance.

May import: nothing of the project (tests/test_layers.py holds every package to its layer).
"""

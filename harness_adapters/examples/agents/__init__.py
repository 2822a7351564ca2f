"""Small agent programs for the example configs (``harness_adapters/examples/configs/``).

Each ``*_agent`` module is an ordinary program built on one agent framework or SDK, run by the
``command`` adapter as ``python -m harness_adapters.examples.agents.<module>``. None of them
knows about the appliance: they read the endpoint from the variables their framework reads
(``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``, ...), take the model and the question as
arguments, and write their final answer to ``answer.txt`` in the working directory (the prompts,
the ``add`` tool and the command line they share are in ``calculator``). The
rewards (``answers.answer_reward`` for questions, ``task_tests`` for coding tasks) are judged
by the appliance after the agent exits, never by the agent.
"""

"""An agent on ``litellm``: one ``completion`` call through its ``openai/`` route.

Run as ``python -m harness_adapters.examples.agents.litellm_agent --model openai/M "question"``.
litellm's ``openai/`` route reads ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` and
``OPENAI_API_KEY`` (the rollout's endpoint). Offline: ``LITELLM_LOCAL_MODEL_COST_MAP=True``
(set by the config) keeps it from downloading its model cost map at import. The answer goes to
``answer.txt``.
"""

from __future__ import annotations

import litellm

from harness_adapters.examples.agents import calculator


def main() -> None:
    parser = calculator.question_parser(
        __doc__, model_help="a litellm model name, e.g. openai/<served model>"
    )
    args = parser.parse_args()
    reply = litellm.completion(
        model=args.model,
        messages=[
            {"role": "system", "content": calculator.ANSWER_ONLY},
            {"role": "user", "content": args.question},
        ],
        num_retries=2,
    )
    calculator.write_answer(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()

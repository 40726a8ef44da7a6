"""lm-eval task class for prepared rows whose ``prompt`` is a conversation (messages ending with
a user turn: ``data/prepared``'s schema).

lm-eval builds a document's prompt as one user turn (``doc_to_text``), after the run's system
instruction. A document here is asked as the conversation it is -- its system turn, earlier
turns and last user turn -- through the model's chat template, after the system instruction
(the model's own system prompt) unless the conversation has its own system turn: how the
training stages and ``heldout``/``evaluate`` prompt it (``alignpipe.measure.generation``).
Zero-shot only: a few-shot example has no place in someone else's conversation.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.task import ConfigurableTask

from alignpipe.measure.generation import prompt_messages


class ConversationTask(ConfigurableTask):
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config={k: v for k, v in (config or {}).items() if k != "class"})

    def fewshot_context(
        self,
        doc: dict,
        num_fewshot: int,
        system_instruction: str | None = None,
        apply_chat_template: bool = False,
        fewshot_as_multiturn: bool = False,
        chat_template=None,
        gen_prefix: str | None = None,
    ) -> str:
        if num_fewshot:
            raise ValueError(f"{self.config.task}: conversation documents are zero-shot; set num_fewshot: 0")
        if not (apply_chat_template and chat_template):
            raise ValueError(
                f"{self.config.task}: conversation documents need a chat template (apply_chat_template)"
            )
        turns = [{"role": m["role"], "content": m["content"]} for m in doc["prompt"]]
        return chat_template(prompt_messages(turns, system_instruction), add_generation_prompt=True)

"""A model's chat template, rendered as transformers renders it, without transformers.

The ``omni`` scheduler loads no transformers (its stub stays small); the
audio route still needs the thinker's prompt as the model's own template
makes it (the talker finds the user turns and the assistant's opening in
it). The template is the tokenizer's (``chat_template.jinja``, or
``chat_template`` in ``tokenizer_config.json``), rendered in the sandboxed
Jinja environment transformers uses, with its filters and globals, and the
tokenizer's special tokens as variables."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


class ChatTemplate:
    def __init__(self, source: str, variables: dict[str, str]):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[jinja2.ext.loopcontrols])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        self.template = environment.from_string(source)
        self.variables = variables

    @classmethod
    def of_model(cls, folder: Path) -> ChatTemplate:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = folder / "chat_template.jinja"
        source = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if not isinstance(source, str):
            raise ValueError(f"{folder}: the tokenizer has no chat template (chat_template.jinja)")
        # the tokenizer's special tokens, which templates read (bos_token, eos_token, ...)
        variables = {key: value if isinstance(value, str) else value.get("content", "")
                     for key, value in config.items()
                     if key.endswith("_token") and isinstance(value, str | dict)}
        return cls(source, variables)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.variables)

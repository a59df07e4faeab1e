"""Chat templates: a conversation rendered as transformers' ``apply_chat_template`` renders it, and
the assistant's part of the text found.

The template (tokenizer_config.json's ``chat_template``, or a .jinja file) is compiled as transformers
compiles it (the same sandbox, filters and globals) and sees what transformers passes: the messages
with their reasoning under every name templates read, the record's tools, the special tokens. The
conversation is rendered once. The assistant's part is what the template's ``{% generation %}``
blocks hold, where it has them (transformers' assistant-mask convention). Else each assistant turn is
located in that one render (``assistant_spans``): it starts where the template's generation prompt
ends (what ``add_generation_prompt=True`` appends, as far as the render shows it: a reasoning
template's ``<think>`` opener may be missing there) and ends with the first special token after the
turn's content (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...: what makes the model stop), so whatever
the template writes in between (a reasoning block, tool calls) is learned too. Templates that render
a conversation's prefixes differently inside the whole (Qwen3, gpt-oss, Phi-3.5, DeepSeek-R1,
Mistral with a system message) need nothing more.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re

from meshtrain.config import DataConfig
from meshtrain.data.tokenizer import special_token_pattern
from meshtrain.errors import DataError


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_chat_template(cfg: DataConfig) -> tuple[str, dict[str, str]]:
    """The template and the special tokens it may use (bos_token, eos_token, ...)."""
    if cfg.chat_template is not None:
        path = pathlib.Path(cfg.chat_template)
    elif cfg.tokenizer != "byte":
        tok = pathlib.Path(cfg.tokenizer)
        path = (tok if tok.is_dir() else tok.parent) / "tokenizer_config.json"
    else:
        raise DataError("data.format=chat needs a chat template: set data.chat_template to a tokenizer_config.json "
                        "or a .jinja file, or data.tokenizer to a model's tokenizer")
    if not path.is_file():
        raise DataError(f"data.chat_template: {str(path)!r} does not exist; give a tokenizer_config.json holding a "
                        "chat_template, or a .jinja file")
    if path.suffix != ".json":
        return path.read_text(), {}
    config = json.loads(path.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        jinja = path.parent / "chat_template.jinja"
        if not jinja.is_file():
            raise DataError(f"{path}: no chat_template (nor a chat_template.jinja beside it); set data.chat_template")
        template = jinja.read_text()
    special = {k: _token_text(v) for k, v in config.items()
               if k.endswith("_token") and isinstance(_token_text(v), str)}
    return template, special


def compile_template(template: str):
    """The template compiled the way transformers compiles chat templates (checked: 5.x)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class GenerationSpans(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` blocks (its AssistantTracker): the
        template marks what the assistant generates; while ``recording`` holds (the blocks rendered so
        far, the spans), each block's character span in the output is recorded."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.recording: tuple[list[str], list[tuple[int, int]]] | None = None
            environment.extend(generation_spans=self)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller) -> str:
            text = caller()
            if self.recording is not None:
                blocks, spans = self.recording
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationSpans])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template, messages: list[dict], special: dict[str, str], turn_ends: frozenset[str] = frozenset(),
                tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns: the template's own
    ``{% generation %}`` blocks where it has them (rendered as transformers renders them for
    ``return_assistant_tokens_mask``), else located in the render (``assistant_spans``). A record the
    template refuses (its raise_exception, or a value of a type it cannot take) is a DataError."""
    import jinja2

    messages = with_reasoning_aliases(messages)
    context = {"tools": tools, "documents": None, **special}  # what transformers passes beside the messages
    blocks, spans = [], []
    tracker = template.environment.generation_spans
    tracker.recording = (blocks, spans)
    try:
        for block in template.generate(messages=messages, add_generation_prompt=False, **context):
            blocks.append(block)
        text = "".join(blocks)
        return text, spans or assistant_spans(template, messages, context, text, turn_ends)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise DataError(f"the chat template refused it: {type(e).__name__}: {e}. Fix: correct the record to the "
                        "form this template takes, or set data.bad_records=skip") from None
    finally:
        tracker.recording = None


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read (Qwen3 ``reasoning_content``, gpt-oss
    ``thinking``), from whichever it has: transformers' ``_alias_reasoning_fields`` (checked: 5.24)."""
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        aliased.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return aliased


def assistant_spans(template, messages: list[dict], context: dict, text: str,
                    turn_ends: frozenset[str]) -> list[tuple[int, int]]:
    """Each assistant turn's span in ``text``, the whole conversation rendered once. Walking the
    messages in order, a cursor moves past each user/tool content found; an assistant turn opens
    after its generation prompt's first occurrence past the cursor and closes after the first of
    ``turn_ends`` past its content (or at the content's end when none comes before the next
    message); a turn of tool calls alone as ``_end_of_tool_calls`` says."""
    ends = special_token_pattern(turn_ends) if turn_ends else None
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") != "assistant":
            # a system message may be moved (Mistral writes it into the last user turn): no anchor
            if message.get("role") != "system" and (found := _located(text, content, cursor)):
                cursor = found[1]
            continue
        prompt = _generation_prompt(template, messages[:i], context)
        opened = _after_prompt(text, prompt, cursor)
        start = cursor if opened is None else opened
        found = _located(text, content, start)
        if found is None:
            if isinstance(content, str) and content.strip():
                raise DataError(f"message {i} (assistant): its content is not in the template's rendering of the "
                                "conversation, so its tokens cannot be marked as targets. Fix: give the template "
                                "{% generation %} blocks, or use data.format=prompt_response")
            # No content (tool calls only): the turn is what the template writes, after its generation
            # prompt, or where there is none (Mistral), after the previous turn's closing marker ([/INST]).
            if opened is None and ends is not None:
                past_space = len(text) - len(text[start:].lstrip())
                if (closing := ends.match(text, past_space)) is not None:
                    start = closing.end()
            found = (start, start)
        end = found[1]
        if ends is not None:
            later = next((m.get("content") for m in messages[i + 1:] if m.get("role") != "system"), None)
            limit = (_located(text, later, end) or (len(text),))[0]
            if found[0] == found[1]:  # tool calls alone: they may hold special tokens of their own
                end = _end_of_tool_calls(text, end, limit, context.get("eos_token"), prompt, ends)
            elif (marker := ends.search(text, end, limit)) is not None:
                end = marker.end()
        spans.append((found[0] if opened is None else opened, end))
        cursor = end
    return spans


def _end_of_tool_calls(text: str, start: int, limit: int, eos: str | None, prompt: str, ends: re.Pattern) -> int:
    """Where a turn of tool calls alone ends, before ``limit`` (the next message's content): after the
    tokenizer's EOS (a chat model's end of turn: Mistral's [TOOL_CALLS]...</s>), else just before the
    next turn opens (the special token the generation prompt starts with: gpt-oss's <|start|> after
    <|call|>), else after the first special token."""
    if eos and (stop := text.find(eos, start, limit)) >= 0:
        return stop + len(eos)
    opener = ends.match(prompt)
    if opener is not None and (following := text.find(opener.group(), start, limit)) >= 0:
        return len(text[:following].rstrip())
    marker = ends.search(text, start, limit)
    return start if marker is None else marker.end()


def _generation_prompt(template, history: list[dict], context: dict) -> str:
    """What ``add_generation_prompt=True`` appends to ``history`` ('' where the template has none or
    cannot render the history alone)."""
    try:
        without = template.render(messages=history, add_generation_prompt=False, **context)
        with_prompt = template.render(messages=history, add_generation_prompt=True, **context)
    except Exception:
        return ""
    return with_prompt[len(without):] if with_prompt.startswith(without) else ""


def _after_prompt(text: str, prompt: str, cursor: int) -> int | None:
    """Where the generation prompt's first occurrence past ``cursor`` ends: its longest prefix found
    there, at least half of it (a reasoning template's prompt opens a ``<think>`` block that its
    rendered history drops)."""
    if not prompt:
        return None
    shortest = (len(prompt) + 1) // 2
    at = text.find(prompt[:shortest], cursor)
    if at < 0:
        return None
    length = shortest
    while length < len(prompt) and text.startswith(prompt[:length + 1], at):
        length += 1
    return at + length


def _located(text: str, content, cursor: int) -> tuple[int, int] | None:
    """The span of ``content`` in ``text`` past ``cursor``, as the template may have written it:
    whole, stripped, or without a reasoning part before ``</think>``."""
    if not isinstance(content, str) or not content.strip():
        return None
    answer = content.split("</think>")[-1]
    for candidate in dict.fromkeys((content, content.strip(), answer.strip())):
        if candidate and (at := text.find(candidate, cursor)) >= 0:
            return at, at + len(candidate)
    return None


def written_contents(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Where the messages' contents and reasoning lie in their rendered ``text`` (the ranges whose
    special-token text ``data.special_text_in_content=text`` spells out). A system message is looked
    for anywhere (templates move it); the rest in order."""
    ranges, cursor = [], 0
    for message in messages:
        for field in ("reasoning_content", "content"):  # in the order templates write them
            found = _located(text, message.get(field), 0 if message.get("role") == "system" else cursor)
            if found is not None:
                ranges.append(found)
                if message.get("role") != "system":
                    cursor = found[1]
    return ranges

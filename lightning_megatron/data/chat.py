"""Chat data for instruction tuning (SFT) of decoders, without Lightning: records, the chat template, the
loss mask, truncation, packing and the training sample order.

Records (:func:`read_chat_records`, one JSON object per line of a ``.jsonl`` file) are either

- ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}``, or
- ``{"prompt": "...", "completion": "..."}`` (the user's turn and the assistant's),

each with an optional ``"system"`` (a system message put first). A message's other keys reach the
template as they are (keys whose value is null are dropped, as transformers drops them).

:class:`ChatTokenizer` is a Hugging Face tokenizer folder (``tokenizer.json``; ``tokenizer_config.json``'s
special tokens and ``chat_template``; a ``chat_template.jinja`` beside them wins over the config's, as in
transformers) or a bare ``tokenizer.json``. :class:`ChatTemplate` renders messages as transformers'
``apply_chat_template`` does: a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``,
``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson``,
``{% generation %}``), the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables,
and the rendered text encoded without added special tokens. A tokenizer without a template gets
:data:`DEFAULT_CHAT_TEMPLATE` (ChatML's layout, every turn ended by the tokenizer's EOS). Nothing but JSON
and the sandboxed template is read from the files; no code from them runs.

The loss mask (:func:`encode_chat`) covers the tokens of every assistant message's content and of its
end-of-turn token: the first special token (an added ``special`` token, or the EOS) after the content.
The template's own ``{% generation %}`` spans when it has them; else the span of message ``i`` is what
rendering ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt, from the
content on (a token counts when its characters overlap the span, transformers' rule). A template that
renders a message differently once later messages follow is refused.

An encoded example (:data:`Example`: ids and their loss mask) becomes samples, packed or not, in the training
order of :mod:`lightning_megatron.data.sft_samples`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from lightning_megatron.data.corpus import read_utf8_text, text_lines

__all__ = ["DEFAULT_CHAT_TEMPLATE", "SAMPLE_CHATS", "ChatRecord", "ChatTemplate", "ChatTokenizer", "Example",
           "encode_chat", "encode_prompt", "packaged_sample_file", "read_chat_records", "tokens_in_spans"]

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""The template of a tokenizer without one: ChatML's layout (``<|im_start|>role\\ncontent``) with every turn
ended by the tokenizer's EOS (``<|im_start|>`` is plain text to a tokenizer that lacks it)."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' named special tokens: the template sees each one the tokenizer sets."""

FALLBACK_EOS = "<|endoftext|>"
"""The EOS of a tokenizer whose folder names none (GPT-2's, and the packaged BPE's)."""

SAMPLE_CHATS = "sft_sample.jsonl"
"""A few dozen short chats written for this package (``data/sft_sample.jsonl``): the tiny recipes' data."""

Example = tuple[np.ndarray, np.ndarray]
"""(ids int64 [n], mask bool [n]): an encoded example; ``mask[j]``: token ``j`` is a target."""


# ------------------------------------------------------------------ records


@dataclass(frozen=True)
class ChatRecord:
    """One example: its messages (rendered by the template), or a raw prompt/completion."""

    messages: list[dict[str, Any]]
    """The conversation, system message first when there is one."""
    where: str
    """The file and line, for errors."""
    prompt: str | None = None
    completion: str | None = None
    line: int = 0
    """The line of the file (1-based)."""


def packaged_sample_file() -> Path:
    """Path of :data:`SAMPLE_CHATS` inside the installed package."""
    from importlib.resources import files

    path = Path(str(files("lightning_megatron.data") / SAMPLE_CHATS))
    if not path.is_file():
        raise FileNotFoundError(f"the packaged sample chats {str(path)!r} are missing: the lightning-megatron "
                                f"installation is incomplete; reinstall it, or pass train_file=...")
    return path


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not isinstance(value.get("role"), str):
        raise ValueError(f"{where}: a message is an object with a string 'role' and 'content', got {value!r:.80}")
    if "content" not in value:
        raise ValueError(f"{where}: the {value['role']!r} message has no 'content' (its keys: {sorted(value)})")
    if not isinstance(value.get("content"), str):
        raise ValueError(f"{where}: the {value['role']!r} message's 'content' is not a string (text-only chats: "
                         f"content parts are not supported)")
    return {k: v for k, v in value.items() if v is not None}


def read_chat_records(path: str | os.PathLike[str], where: str, *, prompts: bool = False) -> list[ChatRecord]:
    """The records of a ``.jsonl`` file (see the module docstring); ``where`` names it in errors. Training
    records need an assistant message (a ``completion``); ``prompts=True`` reads prompts to continue
    instead: no ``completion``, and messages that do not end with the assistant's."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist (relative paths start at {os.getcwd()!r})")
    records = []
    for line_no, line in enumerate(text_lines(read_utf8_text(path, where)), 1):
        if not line.strip():
            continue
        at = f"{where} line {line_no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{at} is not JSON ({error}): a .jsonl file holds one JSON object per line") from None
        if not isinstance(rec, dict) or ("messages" in rec) == ("prompt" in rec):
            raise ValueError(f"{at}: a record is an object with 'messages' (a list of role/content messages) or "
                             f"'prompt' (and 'completion'), one of the two; got {str(rec)[:80]!r}")
        system = rec.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{at}: 'system' is not a string")
        head = [{"role": "system", "content": system}] if system is not None else []
        if "messages" in rec:
            if not isinstance(rec["messages"], list) or not rec["messages"]:
                raise ValueError(f"{at}: 'messages' is not a non-empty list of messages")
            messages = [_message(m, at) for m in rec["messages"]]
            if head and messages[0]["role"] == "system":
                raise ValueError(f"{at} has both 'system' and a system message first: keep one")
            records.append(ChatRecord(head + messages, at, line=line_no))
            roles = [m["role"] for m in messages]
            if not prompts and "assistant" not in roles:
                raise ValueError(f"{at} has no assistant message (roles {roles}): nothing to learn from")
            if prompts and roles[-1] == "assistant":
                raise ValueError(f"{at} ends with the assistant's message: a prompt ends where the model's answer "
                                 f"begins; drop that message")
            continue
        prompt, completion = rec["prompt"], rec.get("completion")
        if not prompts and "completion" not in rec:
            raise ValueError(f"{at} has a 'prompt' and no 'completion' (the answer to learn; its keys: {sorted(rec)})")
        if not isinstance(prompt, str) or (not prompts and not isinstance(completion, str)):
            raise ValueError(f"{at}: 'prompt' and 'completion' must be strings")
        if prompts and completion is not None:
            raise ValueError(f"{at} has a 'completion': a prompt to continue has none (drop it)")
        user = [{"role": "user", "content": prompt}]
        answer = [{"role": "assistant", "content": completion}] if completion is not None else []
        records.append(ChatRecord(head + user + answer, at, prompt=prompt, completion=completion, line=line_no))
    if not records:
        raise ValueError(f"{where} holds no records (one JSON object per line)")
    return records


# ------------------------------------------------------------------ the template


class _GenerationTracker:
    """transformers' ``{% generation %} ... {% endgeneration %}``: the character span of each block."""

    @staticmethod
    def extension() -> type:
        import jinja2
        from jinja2.ext import Extension

        class Generation(Extension):
            tags = {"generation"}

            def __init__(self, environment: Any) -> None:
                super().__init__(environment)
                environment.extend(activate_tracker=self.activate_tracker)
                self._tracking: ContextVar = ContextVar("generation_spans", default=None)

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

            @jinja2.pass_eval_context
            def _generation(self, context: Any, caller: Any) -> str:
                text = caller()
                tracking = self._tracking.get()
                if tracking is not None:  # the text the template yielded so far is where this block starts
                    blocks, spans = tracking
                    start = len("".join(blocks))
                    spans.append((start, start + len(text)))
                return text

            @contextmanager
            def activate_tracker(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
                token = self._tracking.set((blocks, spans))
                try:
                    yield
                finally:
                    self._tracking.reset(token)

        return Generation


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """The template in transformers' sandbox (its globals and filters; jinja2 >= 3.1.6, as it requires)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox escapes), found "
                          f"{jinja2.__version__}: pip install -U jinja2")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict() without attribute access to the type
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (CPython internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                check_name(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTracker.extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)


class ChatTemplate:
    """A Jinja chat template and the variables it sees (the tokenizer's special tokens)."""

    def __init__(self, source: str, variables: Mapping[str, str]) -> None:
        self.source, self.variables = source, dict(variables)
        self._template = _compile(source)
        self.has_generation_tags = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The text ``apply_chat_template(messages, tokenize=False)`` gives."""
        return self._template.render(messages=list(messages), tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.variables)

    def render_tracked(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of its ``{% generation %}`` blocks."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with self._template.environment.activate_tracker(blocks, spans):
            for block in self._template.generate(messages=list(messages), tools=None, documents=None,
                                                 add_generation_prompt=False, **self.variables):
                blocks.append(block)
        return "".join(blocks), spans


# ------------------------------------------------------------------ the tokenizer


def _token_text(value: Any) -> str | None:
    """A special token of a tokenizer config: a string, or an AddedToken's ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(read_utf8_text(path))
    except ValueError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} is not a JSON object")
    return value


def _generation_stop_ids(folder: Path, eos_id: int, vocab_size: int) -> tuple[int, ...]:
    """``eos_id`` and the ``eos_token_id`` (an id or a list) of ``folder``'s ``generation_config.json``, as
    transformers' ``generate`` stops at any of them; an id outside the vocabulary is refused, naming the file."""
    path = folder / "generation_config.json"
    named = _read_json(path).get("eos_token_id") if path.is_file() else None
    ids = [named] if isinstance(named, int) else list(named or [])
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{str(path)!r}: eos_token_id {bad} are not ids of the tokenizer's {vocab_size} tokens")
    return tuple(dict.fromkeys([eos_id, *ids]))


class ChatTokenizer:
    """A Hugging Face tokenizer for chat data (see the module docstring).

    Args:
        path: a folder with ``tokenizer.json`` (and ``tokenizer_config.json``, ``special_tokens_map.json``,
            ``chat_template.jinja``), or a ``tokenizer.json`` (those files beside it are read too).
        eos_token: the end-of-sequence token (what ``eod`` is, where ``predict`` stops); ``None``: the
            config's ``eos_token``, else ``<|endoftext|>`` when the vocabulary has it. The template's
            ``eos_token`` variable is this one.
        chat_template: a ``.jinja`` file, a template string, or the name of one of the config's templates;
            ``None``: the folder's (``chat_template.jinja``, else the config's ``default`` one), else
            :data:`DEFAULT_CHAT_TEMPLATE`.
    """

    def __init__(self, path: str | os.PathLike[str], *, eos_token: str | None = None,
                 chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer {str(path)!r}: {str(file)!r} does not exist; SFT data needs a Hugging "
                                    f"Face tokenizer.json (or a folder holding one)")
        self.path, folder = file, file.parent
        self._tokenizer = Tokenizer.from_file(str(file))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        names = _read_json(folder / "special_tokens_map.json") if (folder / "special_tokens_map.json").is_file() else {}
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        declared = config.get("added_tokens_decoder") or {}
        missing = [_token_text(t) for t in declared.values() if _token_text(t) not in vocab]
        if missing:
            raise ValueError(f"{str(folder / 'tokenizer_config.json')!r} adds {missing[:5]}, which {str(file)!r} "
                             f"lacks: save the tokenizer again with transformers (save_pretrained) so that both agree")
        self.special_tokens = {n: t for n in SPECIAL_TOKEN_NAMES
                               if (t := _token_text(config.get(n)) or _token_text(names.get(n))) is not None}
        """The named special tokens the template sees (``bos_token``, ``eos_token``, ...)."""
        eos = eos_token or self.special_tokens.get("eos_token") or (FALLBACK_EOS if FALLBACK_EOS in vocab else None)
        if eos is None or eos not in vocab:
            why = "none named" if eos is None else f"{eos!r} is not in the vocabulary"
            raise ValueError(f"tokenizer {str(path)!r}: no end-of-sequence token ({why}); pass eos_token= (the "
                             f"token that ends the assistant's turns)")
        self.special_tokens["eos_token"] = eos
        self.eos_token, self.eos_id = eos, vocab[eos]
        self.stop_ids = _generation_stop_ids(folder, self.eos_id, len(vocab))
        """The ids that end a generation (``generate``, ``predict``): EOS and the folder's ``generation_config.json``
        ``eos_token_id`` (Llama 3.1 Instruct names three)."""
        pad = self.special_tokens.get("pad_token")
        self.pad_id = vocab.get(pad, self.eos_id) if pad is not None else self.eos_id
        """Id of the padding (the pad token, else EOS; never a target)."""
        added = self._tokenizer.get_added_tokens_decoder().values()
        self.end_tokens = tuple(dict.fromkeys([eos, *(t.content for t in added if t.special)]))
        """Tokens that end a turn: the EOS and the special added tokens."""
        self._vocab_size = max(vocab.values()) + 1
        self.chat_template, self.template_source = self._template(folder, config, chat_template)

    @property
    def inv_vocab(self) -> list[str]:
        """The pieces in id order (added tokens included; an id without a piece is ``""``): what a checkpoint
        records of the vocabulary (:func:`~lightning_megatron.data.dataset_vocab.vocabulary_record`)."""
        pieces = [""] * self._vocab_size
        for token, index in self._tokenizer.get_vocab(with_added_tokens=True).items():
            pieces[index] = token
        return pieces

    @staticmethod
    def _template(folder: Path, config: dict[str, Any], choice: str | None) -> tuple[str, str]:
        """(template, where it came from)."""
        named = config.get("chat_template")
        if isinstance(named, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in named if isinstance(t, Mapping)}
        if choice is not None:
            if isinstance(named, dict) and choice in named:
                return named[choice], f"tokenizer_config.json[{choice!r}]"
            if "{{" in choice or "{%" in choice:
                return choice, "chat_template="
            if Path(choice).is_file():
                return read_utf8_text(Path(choice)), str(choice)
            raise ValueError(f"chat_template={choice!r} is neither a file, a template (with {{{{ or {{%), nor one of "
                             f"the tokenizer's templates {sorted(named) if isinstance(named, dict) else []}")
        if (folder / "chat_template.jinja").is_file():
            return read_utf8_text(folder / "chat_template.jinja"), "chat_template.jinja"
        if isinstance(named, dict):
            if "default" not in named:
                raise ValueError(f"the tokenizer's templates are {sorted(named)}, none 'default': pick one with "
                                 f"chat_template=")
            return named["default"], "tokenizer_config.json['default']"
        if isinstance(named, str):
            return named, "tokenizer_config.json"
        return DEFAULT_CHAT_TEMPLATE, "default"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": self._tokenizer.to_str()}

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer

        self.__dict__.update(state)
        self._tokenizer = Tokenizer.from_str(state["_tokenizer"])

    @property
    def vocab_size(self) -> int:
        """One more than the largest id, added tokens included (``len(tokenizer)`` of transformers)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The EOS id (Megatron's name: where ``predict`` stops)."""
        return self.eos_id

    def template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self.special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> Any:
        """The ``tokenizers`` encoding (``ids``, character ``offsets``) of ``text``."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------ the loss mask


def tokens_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool [n]: which tokens' character ``offsets`` overlap one of the sorted ``spans`` (transformers'
    ``assistant_masks`` rule)."""
    mask = np.zeros(len(offsets), dtype=bool)
    k = 0
    for j, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[j] = end > spans[k][0]
    return mask


def _assistant_spans(template: ChatTemplate, messages: list[dict[str, Any]], text: str,
                     end_tokens: Sequence[str], where: str) -> list[tuple[int, int]]:
    """The character span of every assistant message's content and end-of-turn token in ``text``."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True) if i else ""
        through = template.render(messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise ValueError(f"{where}: the chat template renders message {i} (the assistant's) differently once "
                             f"later messages follow, so its tokens cannot be told apart; use a template that renders "
                             f"each turn the same, or mark the assistant's text with {{% generation %}}")
        start, stop = len(before), len(through)
        content = message["content"]  # as written where the template keeps it (ChatML), else trimmed (Llama 3)
        at = text.find(content, start, stop) if content.strip() else -1
        if at < 0:
            content = content.strip()
            at = text.find(content, start, stop) if content else -1
        rest = start if at < 0 else at + len(content)
        start = start if at < 0 else at
        ends = [(p, t) for t in end_tokens if (p := text.find(t, rest, stop)) >= 0]
        stop = min(p + len(t) for p, t in ends) if ends else rest + len(text[rest:stop].rstrip())
        spans.append((start, stop))
    return spans


def encode_chat(record: ChatRecord, tokenizer: ChatTokenizer, template: ChatTemplate, *,
                raw: bool = False) -> Example:
    """(ids, mask) of one training record: the template's rendering, encoded as transformers'
    ``apply_chat_template(tokenize=True)`` encodes it, the targets the assistant's content and end-of-turn
    tokens. ``raw`` (prompt/completion records): ``prompt + completion`` encoded with the tokenizer's
    special tokens (``tokenizer(text)``), then the EOS; the targets the completion and the EOS."""
    if raw and record.prompt is not None:
        if record.messages[0]["role"] == "system":
            raise ValueError(f"{record.where}: a 'system' needs the chat template (raw prompt/completion has none)")
        text = record.prompt + (record.completion or "")
        encoding = tokenizer.encode(text, add_special_tokens=True)
        mask = tokens_in_spans(encoding.offsets, [(len(record.prompt), len(text))])
        return (np.array([*encoding.ids, tokenizer.eos_id], dtype=np.int64), np.append(mask, True))
    if template.has_generation_tags:
        text, spans = template.render_tracked(record.messages)
    else:
        text = template.render(record.messages)
        spans = _assistant_spans(template, record.messages, text, tokenizer.end_tokens, record.where)
    encoding = tokenizer.encode(text)
    return np.asarray(encoding.ids, dtype=np.int64), tokens_in_spans(encoding.offsets, spans)


def encode_prompt(record: ChatRecord, tokenizer: ChatTokenizer, template: ChatTemplate, *,
                  raw: bool = False) -> tuple[str, list[int]]:
    """(text, ids) of a prompt to continue: the messages with the template's generation prompt, or (``raw``)
    the prompt text with the tokenizer's special tokens."""
    if raw and record.prompt is not None:
        return record.prompt, tokenizer.encode(record.prompt, add_special_tokens=True).ids
    text = template.render(record.messages, add_generation_prompt=True)
    return text, tokenizer.encode(text).ids

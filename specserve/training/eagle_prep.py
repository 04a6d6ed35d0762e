"""The EAGLE trainer's text, made while the engine loads: the ShareGPT chats split into
held-out and training chats, their turn prompts and their fixed-text conversations, all
tokenized with the target's tokenizer.

None of it needs the engine, and on a GPU the engine takes a minute or more to start
(H100, Qwen2.5-Coder-1.5B GGUF on a fresh machine, py-spy: weights 27 s, the GGUF
tokenizer rebuilt 35 s, kernels and CUDA graphs 15 s), while the text took 30 s more
after it (13.6 s of prompts, 10.8 s of fixed text, the chats and the split). So on a GPU it
is made in a background process started first (TextPreparation), with its own tokenizer
(the same files as the engine's) and its own pools of tokenizing workers, and comes back
pickled in two parts: the prompts, which generation needs once the engine is ready, then
the fixed text, made while the answers are generated and needed only for training. On a
CPU it is made in this process: there the engine is quick and a spawned process's start-up
(its imports) would cost more than it hides.
"""
from __future__ import annotations

import multiprocessing
import pickle
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.training.chat_pool import available_cores
from specserve.training.eagle_chats import Messages, reply_text_conversations, training_chats, turn_prompts
from specserve.training.eagle_data import Conversation

# cores a background preparation leaves to the process loading the engine (its weights and
# kernel compiles run on one core at a time)
ENGINE_CORES = 1


@dataclass(frozen=True)
class TextSettings:
    """What the text depends on (train_eagle's arguments), picklable for the background process."""
    model_path: str | None           # None: the default model (SmolLM2-135M)
    dataset_path: str | None
    exclude_dataset_path: str | None
    prompt_turns: str                # "all" or "first"
    seed: int
    held_out: int                    # prompts kept apart for the accept length
    max_prompt_len: int
    num_prompts: int | None
    text_chats: int
    max_text_len: int
    need_prompts: bool = True        # False: the answers are read back (--resume), only the fixed text is made
    cores: int | None = None         # for the tokenizing workers; None: every core this process may use


@dataclass
class PreparedText:
    held_out_prompts: list[list[int]]
    prompts: list[list[int]]              # for the training answers, in the shuffled chats' order
    train_chats: int
    stage_seconds: dict[str, float] = field(default_factory=dict)   # stage -> seconds, in order
    # fixed-text conversations of the first --text-chats training chats; None until made
    reply_text: list[Conversation] | None = None

    def summary(self) -> str:
        stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.stage_seconds.items())
        fixed = "" if self.reply_text is None else f", {len(self.reply_text)} fixed-text chats"
        return (f"text: {len(self.prompts)} prompts for training from {self.train_chats} chats, "
                f"{len(self.held_out_prompts)} held out{fixed} ({stages})")


def prepare_text(settings: TextSettings, on_prompts: Callable[[PreparedText], None] | None = None) -> PreparedText:
    """The trainer's text, made here; on_prompts(the text without its fixed text) is called
    once the prompts are made (generation needs only them, training the rest)."""
    from specserve.model.loader import default_model_path, load_tokenizer, resolve_model_path
    lap = time.perf_counter()

    def timed(stage: str) -> None:
        nonlocal lap
        now = time.perf_counter()
        seconds[stage], lap = now - lap, now

    seconds: dict[str, float] = {}
    path = resolve_model_path(settings.model_path) if settings.model_path else default_model_path()
    tokenizer = load_tokenizer(path)
    timed("tokenizer")
    chats = training_chats(settings.dataset_path, settings.exclude_dataset_path)
    timed("chats")
    held_out_chats, train_chats = split_chats(chats, tokenizer, settings)
    timed("held-out split")
    text = PreparedText([], [], len(train_chats), seconds)
    if settings.need_prompts:
        text.held_out_prompts = turn_prompts(held_out_chats, tokenizer, settings.max_prompt_len, settings.held_out)
        # the chats are shuffled: a deadline stops generation on a sample of them, every turn
        text.prompts = turn_prompts(train_chats, tokenizer, settings.max_prompt_len, settings.num_prompts,
                                    cores=settings.cores)
        timed("prompts")
    if on_prompts is not None:
        on_prompts(text)
    text.reply_text = reply_text_conversations(train_chats[:settings.text_chats], tokenizer, settings.max_text_len,
                                               cores=settings.cores)
    timed("fixed text")
    return text


def split_chats(chats: list[Messages], tokenizer, settings: TextSettings) -> tuple[list[Messages], list[Messages]]:
    """(held-out, training) chats, shuffled by the seed: the held-out chats are the first ones
    whose prompts make up settings.held_out; none of their turns or replies is trained on."""
    if settings.prompt_turns == "first":
        chats = [chat[:next(i for i, m in enumerate(chat) if m["role"] == "user") + 1]
                 for chat in chats if any(m["role"] == "user" for m in chat)]
    chats = list(chats)
    random.Random(settings.seed).shuffle(chats)
    held_out_prompts = 0
    for count, chat in enumerate(chats):
        if held_out_prompts >= settings.held_out:
            return chats[:count], chats[count:]
        held_out_prompts += len(turn_prompts([chat], tokenizer, settings.max_prompt_len))
    raise ValueError(f"--held-out {settings.held_out}: the dataset has only {held_out_prompts} prompts that fit")


class TextPreparation:
    """prepare_text(settings), made at once here or, with background=True, in a spawned
    process from now on; `prompts()` returns the text once its prompts are made,
    `whole()` once its fixed text is too. As a context manager, a background process still
    running at the exit (the engine failed to load) is stopped."""

    def __init__(self, settings: TextSettings, background: bool):
        self.waited_seconds = 0.0   # how long prompts() and whole() blocked
        self._text: PreparedText | None = None
        self._process = self._connection = None
        if not background:
            self._text = prepare_text(settings)
            return
        # a core for the engine's loading; spawned, not forked: this process has torch loaded (chat_pool.py)
        settings = TextSettings(**{**settings.__dict__, "cores": max(1, available_cores() - ENGINE_CORES)})
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=_prepare_and_send, args=(settings, child_end),
                                        name="specserve-eagle-text")
        self._process.start()
        child_end.close()

    @property
    def in_background(self) -> bool:
        return self._process is not None

    def prompts(self) -> PreparedText:
        if self._text is None:
            self._text = self._receive()
        return self._text

    def whole(self) -> PreparedText:
        text = self.prompts()
        if text.reply_text is None:
            text.reply_text, text.stage_seconds["fixed text"] = self._receive()
            self._process.join()
        return text

    def _receive(self):
        waiting = time.perf_counter()
        try:
            message, error = self._connection.recv()
        except EOFError:
            message, error = None, f"the process exited with code {self._process.exitcode} and sent nothing more"
        self.waited_seconds += time.perf_counter() - waiting
        if error is not None:
            raise RuntimeError(f"preparing the training text failed:\n{error}")
        return message

    def __enter__(self) -> "TextPreparation":
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            self._process.join()


def _prepare_and_send(settings: TextSettings, connection) -> None:
    """The background process: the text without its fixed text as soon as the prompts are
    made, then (the fixed text, its seconds); or the traceback of what failed."""
    sending: threading.Thread | None = None

    def send_prompts(text: PreparedText) -> None:
        nonlocal sending
        payload = pickle.dumps((text, None), protocol=pickle.HIGHEST_PROTOCOL)   # now: `text` changes later
        # written by a thread: the pipe holds 64 KiB and the parent reads once its engine is
        # ready, while this process goes on with the fixed text
        sending = threading.Thread(target=connection.send_bytes, args=(payload,), daemon=True)
        sending.start()

    try:
        text = prepare_text(settings, on_prompts=send_prompts)
        message = ((text.reply_text, text.stage_seconds["fixed text"]), None)
    except BaseException:
        message = (None, traceback.format_exc())
    if sending is not None:
        sending.join()
    connection.send(message)
    connection.close()

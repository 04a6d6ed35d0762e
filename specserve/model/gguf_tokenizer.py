"""A GGUF file's byte-level BPE tokenizer, built from its metadata with the `tokenizers`
library: `build_gguf_tokenizer`.

transformers builds a GGUF's tokenizer only after parsing the whole file with gguf-py's
GGUFReader (a numpy view per element of the 151,936-token and 151,387-merge lists of
Qwen2.5): 14.7 s for the 0.5B on a 2-core CPU; a fresh H200 machine's first engine start
took ~40 s longer than its second (the 0.5B), and the EAGLE trainer's time budget
pays it too. The metadata it needs
is in the header our own parser reads in a fraction of a second (gguf_file.py), and the
tokenizer it builds is a plain byte-level BPE, so this builds the same one directly (Qwen2 and
Qwen3's, Llama 3's and SmolLM2's pre-tokenizers).

"The same" is transformers' GGUF conversion (5.24): the file's vocabulary and merges, the
normalizer and pre-tokenizer of the file's `tokenizer.ggml.pre`, ByteLevel decoding, control
tokens as special added tokens and user-defined ones as plain added tokens, and
bos/eos/unk/pad from the file's ids. Tests compare the two on real text, chat templates and special tokens. Files of other
tokenizer models or pre-tokenizers get None: the caller falls back to transformers.

transformers' own build differs from its saved-and-reloaded form in one way this follows the
latter in: Qwen2's NFC normalizer, which only the tokenizer class (loaded from a directory)
sets. The loader's disk cache served the reloaded form on every load after a machine's first.
"""
from __future__ import annotations

from typing import Any

# llama.cpp's pre-tokenizer names -> (the split before byte-level BPE: a regex whose matches
# are isolated, then ByteLevel without its own regex, or None for ByteLevel's GPT-2 regex;
# whether text is NFC-normalized first), as transformers' conversion has them.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# Llama 3's: Qwen2's with digits in runs of up to three
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {"qwen2": (_QWEN2_SPLIT, True), "llama-bpe": (_LLAMA3_SPLIT, False),
                                                      "smollm": (None, False)}

# tokenizer.ggml.token_type values (llama.cpp's): control tokens are added as special tokens,
# user-defined ones (Qwen2.5's <tool_call>) as plain added tokens, both kept whole in text
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_TOKEN_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def build_gguf_tokenizer(metadata: dict[str, Any]) -> Any | None:
    """A transformers fast tokenizer for a GGUF's metadata (GGUFFile.metadata), or None when
    the file's tokenizer is not a byte-level BPE with a known pre-tokenizer, or wants special
    tokens added in a way not built here."""
    if metadata.get("tokenizer.ggml.model") != "gpt2" or metadata.get("tokenizer.ggml.pre") not in PRE_TOKENIZERS:
        return None
    import transformers
    from transformers import PreTrainedTokenizerFast

    # transformers 5's fast tokenizer puts the BOS in front where add_bos_token asks (tested);
    # 4.x's generic one ignores the flag. An EOS added to every text is not tested: both go to
    # transformers' own build.
    if metadata.get("tokenizer.ggml.add_eos_token") or (
            metadata.get("tokenizer.ggml.add_bos_token") and int(transformers.__version__.split(".")[0]) < 5):
        return None

    tokens = list(metadata["tokenizer.ggml.tokens"])
    special = {name: tokens[int(metadata[key])] for name, key in _SPECIAL_TOKEN_IDS.items()
               if metadata.get(key) is not None and 0 <= int(metadata[key]) < len(tokens)}
    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(metadata, tokens), chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)), **special)


def _backend(metadata: dict[str, Any], tokens: list[str]) -> Any:
    """The `tokenizers` Tokenizer: BPE over the file's vocabulary and merges, the normalizer and
    pre-tokenizer of its `tokenizer.ggml.pre`, ByteLevel decoding, its control and
    user-defined tokens added."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges,
                            fuse_unk=False, byte_fallback=False))
    split, nfc = PRE_TOKENIZERS[metadata["tokenizer.ggml.pre"]]
    if nfc:
        backend.normalizer = normalizers.NFC()
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    kinds = [int(kind) for kind in metadata.get("tokenizer.ggml.token_type", ())]
    # a control token spelled outside the byte alphabet is a mislabel (every byte-level token is
    # spelled in it): adding it would grow the vocabulary past the model's
    alphabet = _byte_alphabet()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token, kind in zip(tokens, kinds)
                                if kind == _CONTROL and set(token) <= alphabet])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token, kind in zip(tokens, kinds)
                        if kind == _USER_DEFINED])
    return backend


def _byte_alphabet() -> set[str]:
    """The characters byte-level BPE spells bytes with (GPT-2's): printable Latin-1 characters
    stand for their own byte, the other 68 bytes for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    return {chr(code) for code in printable} | {chr(256 + n) for n in range(256 - len(printable))}

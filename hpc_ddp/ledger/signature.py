"""The error signature: an error's first line with what changes from one occurrence to the next masked, so that
the same error at another step, rank, address, file or temporary name has the same signature. A rank writes
it into its exit note (hpc_ddp.ledger.exits); the supervisor compares it with the previous attempt's to tell a
crash loop (the same error twice, no newer checkpoint) from bad luck (hpc_ddp.ledger.rules). No torch.
"""

from __future__ import annotations

import re

_QUOTED_PATH = re.compile(r"(['\"])/[^'\"]*\1")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
# A word that mixes letters and digits and is long enough to be made up rather than written: a hex address or
# id without 0x (7f3a2b1c4d5e, a UUID's parts), a temporary name (tmp/abc3f9a1x, tmpk2j3h4l_), a random suffix.
# Short ones stay (conv2d, fp16, sha256, cuda:0): they name things, and two different errors must not merge.
_TOKEN = re.compile(r"[0-9A-Za-z_]+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _made_up(word: str) -> bool:
    has_digit = any(c.isdigit() for c in word)
    has_letter = any(c.isalpha() for c in word)
    if not (has_digit and has_letter):
        return False
    return len(word) >= 8 or (len(word) >= 6 and set(word) <= HEX_DIGITS)


def _mask_made_up(text: str) -> str:
    return _TOKEN.sub(lambda m: "<id>" if _made_up(m.group(0)) else m.group(0), text)


def signature(type_name: str, message: str) -> str:
    """The error with its numbers, addresses, made-up names and quoted paths masked: equal for the same error at
    another step, rank, address or file (`ValueError: bad batch at step 17` == `... at step 40`)."""
    text = _QUOTED_PATH.sub("'<path>'", message.strip().splitlines()[0] if message.strip() else "")
    text = _NUMBER.sub("N", _mask_made_up(_HEX.sub("0xN", text)))
    return f"{type_name}: {text}"[:300]

"""Pages: the arithmetic every part of a rank does on token counts and prompts, and the page hash chain.

* `page_floor(n, page_size)` / `page_ceil` - `n` tokens rounded down / up to whole pages: the tree, its slots and
  storage hold whole pages only; a batch allocates whole pages.
* `whole_pages(tokens, page_size)` - `tokens` cut to whole pages, as a key of the tree.
* `page_full(n, page_size)` - whether `n` tokens fill their last page: the next token needs a new page.
* `match_key(prompt, page_size)` - what a request's prefix match asks of the cache: its prompt less the last
  token (whose KV the prefill must compute to sample the first output token), in whole pages.
* `page_hashes` - `hashes[i]` = sha256(previous page's hash + page i's tokens as little-endian u32), chained
  from "" (SGLang's `get_hash_str`): a page's storage key names its whole prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

Key = tuple[int, ...]


def page_floor(n: int, page_size: int) -> int:
    """`n` rounded down to a multiple of `page_size`."""
    return n // page_size * page_size


def page_ceil(n: int, page_size: int) -> int:
    """`n` rounded up to a multiple of `page_size` (SGLang's `ceil_paged_tokens`)."""
    return -(-n // page_size) * page_size


def page_full(n: int, page_size: int) -> bool:
    """Whether `n` tokens fill their last page (the next token starts a page)."""
    return n % page_size == 0


def whole_pages(tokens: Sequence[int], page_size: int) -> Key:
    """`tokens` cut to whole pages."""
    return tuple(tokens[: page_floor(len(tokens), page_size)])


def match_key(prompt: Sequence[int], page_size: int) -> Key:
    """The key a request's prefix match asks: `prompt` less its last token, cut to whole pages."""
    return tuple(prompt[: page_floor(len(prompt) - 1, page_size)])


def page_hashes(tokens: Key, page_size: int, prev: str = "") -> list[str]:
    """The chained sha256 of every full page of `tokens`, continuing from the hash `prev`."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[start : start + page_size], dtype="<u4").tobytes()
        prev = hashlib.sha256(bytes.fromhex(prev) + page).hexdigest()
        hashes.append(prev)
    return hashes

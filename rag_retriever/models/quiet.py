"""Quiet model loading: transformers' progress bars and load reports hidden while a model loads.

Example:
    >>> with quiet_transformers():                                   # doctest: +SKIP
    ...     model = AutoModel.from_pretrained(directory)

Shared by the encoder and the reranker (neither depends on the other). It only changes
transformers' own logging switches and restores them; it does not touch the root logger.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import transformers


@contextlib.contextmanager
def quiet_transformers(*, new_head_expected: bool = False) -> Iterator[None]:
    """Hide transformers' weight-loading progress bars (library code prints no noise), and with
    `new_head_expected` its load report too: the warning table it prints for a classification
    head missing from an encoder checkpoint, which the caller reports in its own words."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    if new_head_expected:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)

"""The characters no remote text may bring to the screen or the disk as they are (gpuctl/ui/output.py shows them
as escapes, gpuctl/remote/transfer.py refuses file names holding them)."""

from __future__ import annotations

import re

# C0 but newline and tab, DEL, and C1 (U+0080-U+009F): what a terminal may act on rather than show; the format
# characters that reorder or hide what is shown (the Arabic letter mark, zero-width characters and directional
# marks U+200B-U+200F, the line and paragraph separators, bidi embeddings, overrides and isolates U+202A-U+202E and
# U+2066-U+2069, the word joiner and invisible operators, the BOM); and lone surrogates (a name read with
# surrogateescape), which no stream can encode.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]")

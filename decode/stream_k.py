"""Stream-K work split of the persistent warp-specialized projection (decode/skinny_ws.py, variant "wsk"). No DSL
import: the kernel evaluates these on DSL Int32 values, tests on Python ints, so the formulas use only +, * and //.

The work is `pairs` = tiles x units (tile, unit) pairs in tile-major order (pair p: tile p // units, unit p % units).
CTA c of `ctas` takes the contiguous share [start(c), start(c + 1)), start(c) = pairs * c // ctas. A tile met by
several shares is partial in each: the last tile of one share and the first of the next (a share that starts and
ends inside one tile is both); every other tile of a share is whole.
"""

from __future__ import annotations


def start(c, ctas, pairs):
    """First pair of CTA c's share (start(ctas) = pairs)."""
    return pairs * c // ctas


def owner(p, ctas, pairs):
    """The CTA whose share holds pair p: the largest c with start(c) <= p."""
    return ((p + 1) * ctas - 1) // pairs


def tile_ctas(t, units, ctas, pairs):
    """(first, last) CTA whose share meets tile t."""
    return owner(t * units, ctas, pairs), owner((t + 1) * units - 1, ctas, pairs)


def first_tile(c, units, ctas, pairs):
    """The first tile of CTA c's share; a partial tile's workspace slot is 0 if it is this one, else 1 (the share's
    last tile)."""
    return start(c, ctas, pairs) // units

"""The tile copies' buffer on huge pages (models/huge_pages.py): copies equal to their sources, aligned, sharing
one buffer; after prepack every kernel that reads a tile copy reads the one the packed entry holds."""

from __future__ import annotations

import pytest
import torch

from models import huge_pages, prepack
from models.loading import load_model
from models.native_matmul import AMX, TILED


def test_copies_are_equal_aligned_and_share_one_buffer() -> None:
    torch.manual_seed(0)
    sources = [torch.randn(3, 5).bfloat16(), torch.randn(7).float(), torch.randint(0, 9, (4, 4), dtype=torch.int8)]
    got = huge_pages.copies(sources)
    assert [t.dtype for t in got] == [t.dtype for t in sources]
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, sources))
    assert all(t.data_ptr() % 64 == 0 for t in got)
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # one buffer
    assert got[1].data_ptr() - got[0].data_ptr() >= sources[0].numel() * 2  # no overlap
    assert huge_pages.copies([]) == []


@pytest.mark.skipif(not prepack.supported(torch.bfloat16, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")
def test_prepacked_kernels_read_the_moved_tile_copies(tiny_llama: str) -> None:
    model = load_model(tiny_llama, "bfloat16", "cpu")
    assert prepack.prepack(model) > 0
    linears = [m for m in model.modules() if type(m) is prepack.PrepackedLinear]
    entries = [prepack._PACKED[m.weight.data_ptr()] for m in linears]
    tiled = [e for e in entries if e.tiles is not None]
    if not tiled:
        pytest.skip("no tile copies on this CPU (no AMX nor AVX512-BF16)")
    assert len({e.tiles.untyped_storage().data_ptr() for e in tiled}) == 1  # moved into one buffer
    for entry in tiled:
        pointers = {k[1] for k in (entry.one, entry.few) if k is not None and k[0] in (AMX, TILED)}
        assert pointers <= {entry.tiles.data_ptr()}
    x = torch.randn(3, linears[0].weight.shape[1]).bfloat16()
    torch.testing.assert_close(linears[0](x).float(), (x.float() @ linears[0].weight.float().T), rtol=2e-2,
                               atol=2e-2)

"""A fused pointwise chain evaluated block by block of rows (``FusedPointwise``): each
block's last op writes into its rows of the output (no block-sized result copied), the
output made for the first block; a last op whose result is smaller than its block (a
broadcast) or has no ``out=`` form is made and copied. Every form against the chain run
whole, op by op, in torch."""

import pytest
import torch

from tensorql.algebra import JoinName
from tensorql.physical.kernels import ContractChunk, FusedArg, FusedOp, FusedPointwise, MapChunk

GEN = torch.Generator().manual_seed(7)
SILU = MapChunk("silu", None, "float32")
EXP = MapChunk("exp", None, "float32")
MUL = ContractChunk((("i", "j"), ("i", "j")), ("i", "j"), join=JoinName.MUL)
ADD = ContractChunk((("i", "j"), ("i", "j")), ("i", "j"), join=JoinName.ADD)
ROW_SCALE = ContractChunk((("i",), ("i", "j")), ("i", "j"), join=JoinName.MUL)


def _chain(ops, block_elems):
    return FusedPointwise(tuple(ops), dim=0, block_elems=block_elems)


SWIGLU = [FusedOp(SILU, (FusedArg(0, 0),)), FusedOp(MUL, (FusedArg(-1, None), FusedArg(1, 0)))]
ENDS_IN_A_MAP = [FusedOp(ADD, (FusedArg(0, 0), FusedArg(1, 0))),
                 FusedOp(EXP, (FusedArg(-1, None),))]
ROW_SCALED = [FusedOp(SILU, (FusedArg(0, 0),)),
              FusedOp(ROW_SCALE, (FusedArg(2, 0), FusedArg(-1, None)))]


def _want(name, x, y, rows):
    return {"swiglu": lambda: torch.nn.functional.silu(x) * y,
            "map": lambda: torch.exp(x + y),
            "rows": lambda: rows[:, None] * torch.nn.functional.silu(x)}[name]()


@pytest.mark.parametrize("name, ops", [("swiglu", SWIGLU), ("map", ENDS_IN_A_MAP),
                                       ("rows", ROW_SCALED)])
@pytest.mark.parametrize("block_elems", [64, 96, 1 << 21])  # 8 blocks, uneven blocks, whole
def test_a_chain_in_blocks_equals_the_chain_whole(name, ops, block_elems):
    x, y = torch.randn(37, 8, generator=GEN), torch.randn(37, 8, generator=GEN)
    rows = torch.randn(37, generator=GEN)
    chain = _chain(ops, block_elems)
    got = chain.run([x, y, rows], None)
    torch.testing.assert_close(got, _want(name, x, y, rows), rtol=1e-6, atol=1e-6)
    into = torch.full((37, 8), float("nan"))
    assert chain.run_into([x, y, rows], into) is into
    torch.testing.assert_close(into, _want(name, x, y, rows), rtol=1e-6, atol=1e-6)


def test_the_last_op_writes_its_block_of_the_output_in_place(monkeypatch):
    """No block's result is copied when the last op writes into the output itself."""
    copies = []
    real = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        copies.append(tuple(src.shape))
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    x, y = torch.randn(64, 16, generator=GEN), torch.randn(64, 16, generator=GEN)
    got = _chain(SWIGLU, 16 * 16).run([x, y], None)  # 4 blocks of 16 rows
    monkeypatch.undo()
    assert copies == []
    torch.testing.assert_close(got, torch.nn.functional.silu(x) * y)


def test_a_last_op_smaller_than_its_block_is_broadcast_into_it():
    """A last op whose result broadcasts over the block (a map of a row vector taken whole)
    is made and copied: its values fill every row, as the whole chain's would."""
    col = MapChunk("exp", None, "float32")
    ops = [FusedOp(ADD, (FusedArg(0, 0), FusedArg(1, 0))), FusedOp(col, (FusedArg(2, None),))]
    chain = _chain(ops, 8)
    x = torch.randn(6, 4, generator=GEN)
    v = torch.randn(1, 4, generator=GEN)
    out = torch.empty(6, 4)
    chain.run_into([x, x, v], out)
    torch.testing.assert_close(out, torch.exp(v).expand(6, 4))
    torch.testing.assert_close(chain.run([x, x, v], None), torch.exp(v).expand(6, 4))

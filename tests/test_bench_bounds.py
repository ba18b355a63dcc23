"""``bench/bounds.py`` on the CPU (Triton's interpreter): the weight read really reads every byte (its per-program
xor words against torch's), a byte count that is not a multiple of 4 is read as bytes, and the bound runs present
at each M."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from fp8_backends.providers.triton import _support  # noqa: E402

pytestmark = pytest.mark.skipif(not _support.interpreting(), reason="runs the Triton kernels on the interpreter "
                                "(TRITON_INTERPRET=1); on a GPU bench.block_gemm --bounds times them")


def _xor_per_program(words, per_program):
    n = words.numel()
    padded = torch.zeros(-(-n // per_program) * per_program, dtype=words.dtype)
    padded[:n] = words
    rows = padded.view(-1, per_program)
    while rows.shape[1] > 1:
        rows = rows[:, 0::2] ^ rows[:, 1::2]
    return rows[:, 0]


@pytest.mark.parametrize("shape", [(144, 272), (3, 4099), (5, 7)])
def test_the_weight_read_reads_every_byte_of_each_copy(shape):
    from bench import bounds

    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    weights = [torch.randint(-120, 120, shape, generator=g, dtype=torch.int8).view(torch.float8_e4m3fn)
               for _ in range(2)]
    call = bounds.weight_read(weights)
    large = bounds.weight_read(weights, bounds.READ_WORDS_LARGE)
    for i, w in enumerate(weights):
        words = bounds._words(w)
        assert words.dtype == (torch.int32 if w.numel() % 4 == 0 else torch.uint8)
        assert torch.equal(call(i), _xor_per_program(words, bounds.READ_WORDS))
        assert torch.equal(large(i), _xor_per_program(words, bounds.READ_WORDS_LARGE))
    # a changed byte changes the program's word: the kernel read it
    flipped = weights[0].view(torch.uint8).clone()
    flipped.view(-1)[-1] ^= 1
    assert not torch.equal(bounds.weight_read([flipped.view(torch.float8_e4m3fn)])(0), call(0))


def test_bound_runs_by_m_and_device():
    from bench import bounds

    x = torch.zeros(1, 16).to(torch.float8_e4m3fn)
    w = [torch.zeros(8, 16).to(torch.float8_e4m3fn)]
    assert set(bounds.bound_runs(x, w, 16)) == {"bound:launch", "bound:weight_read",
                                                    "bound:weight_read_64k"}  # no per-tensor GEMM on the CPU
    assert bounds.bound_runs(x, w, 17) == {}
    assert bounds.bound_runs(x, w, 1)["bound:launch"].fn(0).tolist() == [1]

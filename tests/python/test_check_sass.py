"""The SASS check's rule for tiles both consumer warpgroups stage (tests/sass/check_sass.py, staged_gemm_barriers), on
hand-written SASS in cuobjdump's form: the check must fail where the consumers do not meet between the GEMM that reads
the staged tile and the next stmatrix store, whether that store comes later in the code or at the chunk loop's top.
CI runs the check itself on the built kernels (CTest sass_bwd_reductions); a build with that barrier removed failed it
in the main and fused kernels."""
from file_module import load

check_sass = load("tests/sass/check_sass.py", "check_sass")


def sass(*instructions: str) -> str:
    """cuobjdump -sass lines: each instruction at the next 16-byte address, an encoding line after each."""
    out = []
    for i, ins in enumerate(instructions):
        out.append(f"        /*{16 * i:04x}*/                   {ins} ;      /* 0x0000000000007b1d */")
        out.append("                                                                 /* 0x000fe20000010000 */")
    return "\n".join(out)


TOP = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR14], R8", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0",
       "WARPGROUP.DEPBAR.LE gsb0, 0x0", "STSM.16.M88.4 [R15], R168", "BAR.SYNC.DEFER_BLOCKING 0xa, 0x100",
       "WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24].tnspA.tnspB, RZ, !UPT",
       "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24].tnspA.tnspB, R152, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]


def test_guarded_loop_passes():
    text = sass(*TOP, "BAR.SYNC.DEFER_BLOCKING 0xa, 0x100", "STS.64 [R184+0x2d200], R152", "@P1 BRA 0x0000", "EXIT")
    assert check_sass.staged_gemm_barriers(text) == (1, [])


def test_missing_barrier_before_the_loop_top_fails():
    # the next stmatrix store is the next chunk's, at the loop's top (address 0x30), reached by the back edge
    text = sass(*TOP, "STS.64 [R184+0x2d200], R152", "@P1 BRA 0x0000", "EXIT")
    assert check_sass.staged_gemm_barriers(text) == (1, ["40"])


def test_missing_barrier_before_a_later_store_fails():
    # as in the fused kernel: the kl walk's stmatrix store comes later in the code
    text = sass(*TOP, "STS.64 [R184+0x2d200], R152", "STSM.16.M88.4 [R13], R92", "EXIT")
    assert check_sass.staged_gemm_barriers(text) == (1, ["40"])


def test_missing_barrier_on_a_branch_out_of_line_fails():
    # the barrier is on the straight path, but a predicated branch leads past the kernel's exit to a block that stores
    # with stmatrix and branches back: a path without the barrier (the address order alone would not see it)
    text = sass(*TOP, "@P2 BRA 0x00d0", "BAR.SYNC.DEFER_BLOCKING 0xa, 0x100", "@P1 BRA 0x0000", "EXIT",
                "STSM.16.M88.4 [R13], R92", "BRA 0x00a0")
    assert check_sass.staged_gemm_barriers(text) == (1, ["40"])


def test_barrier_on_every_path_passes():
    text = sass(*TOP, "@P2 BRA 0x00d0", "BAR.SYNC.DEFER_BLOCKING 0xa, 0x100", "@P1 BRA 0x0000", "EXIT",
                "BAR.SYNC.DEFER_BLOCKING 0xa, 0x100", "STSM.16.M88.4 [R13], R92", "BRA 0x00b0")
    assert check_sass.staged_gemm_barriers(text) == (1, [])


def test_barrier_not_followed_by_a_gemm_is_not_counted():
    text = sass("BAR.SYNC.DEFER_BLOCKING 0xa, 0x100", "@!P0 BRA 0x0040", "STSM.16.M88.4 [R15], R168",
                "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert check_sass.staged_gemm_barriers(text) == (0, [])

"""bench/static's readers on made-up code: the SASS parser finds the copy loop, its instructions per 16 bytes and the
bytes a warp has in flight before their first use, counts the synchronisation inside and outside the loop, reads the
atomics' semantics from PTX, and the occupancy arithmetic; the bandwidth model's bounds."""

from __future__ import annotations

from bench.static import model, sass

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x0 */
        /*0010*/                   LDG.E.64 R2, desc[UR4][R8.64] ;              /* 0x0 */
        /*0020*/                   IMAD R10, R2, 0x5, RZ ;                      /* 0x0 */
        /*0030*/                   LDG.E.128 R4, desc[UR4][R10.64] ;            /* 0x0 */
        /*0040*/                   LDG.E.128 R12, desc[UR4][R10.64+0x10] ;      /* 0x0 */
        /*0050*/                   STG.E.128 desc[UR4][R20.64], R4 ;            /* 0x0 */
        /*0060*/                   STG.E.128 desc[UR4][R20.64+0x10], R12 ;      /* 0x0 */
        /*0070*/              @!P0 BRA 0x30 ;                                   /* 0x0 */
        /*0080*/                   STL [R1], R3 ;                               /* 0x0 */
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0 */
        /*00a0*/                   ATOMG.E.ADD.64.STRONG.GPU PT, R6, desc[UR4][R22.64], R7 ;   /* 0x0 */
        /*00b0*/              @!P1 BRA 0x10 ;                                   /* 0x0 */
        /*00c0*/                   NOP ;                                        /* 0x0 */
        /*00d0*/                   EXIT ;                                       /* 0x0 */
"""


def test_the_copy_loop_and_its_numbers_are_read_from_sass():
    code = sass.parse_sass(SASS)
    assert [i.op for i in code][:3] == ["LDC", "LDG.E.64", "IMAD"] and "NOP" not in [i.op for i in code]
    out = sass.analyse(SASS, width=16, n_chunks=4)
    loop = out["loop"]
    # The inner loop is 0x30-0x70: five instructions, two 16-byte loads per thread per trip.
    assert loop["instructions"] == 5 and loop["data_bytes_per_thread"] == 32 and loop["instructions_per_16B"] == 2.5
    # Both loads issue before the first store reads R4: 32 bytes per thread in flight, 1 KiB per warp.
    assert loop["inflight_bytes_per_warp"] == 32 * 32
    # The tile loop (0x10-0xb0) adds six instructions around four trips of the inner one.
    per_16b = round((6 + 4 * 5) * 16 / (4 * 32), 2)
    # Its synchronisation (the barrier and the atomic at 0x90-0xa0) is counted as the tile loop's too.
    assert out["tile_loop"] == {
        "instructions_outside_inner": 6, "instructions_per_16B": per_16b, "barriers": {"BAR.SYNC.DEFER_BLOCKING": 1},
        "fences": {}, "atomics": {"ATOMG.E.ADD.64.STRONG.GPU": 1}}  # fmt: skip
    assert out["outside_loop"]["barriers"] == {"BAR.SYNC.DEFER_BLOCKING": 1}
    assert out["outside_loop"]["atomics"] == {"ATOMG.E.ADD.64.STRONG.GPU": 1}
    assert out["spill_stores"] == 1 and out["global_accesses"]["LDG.E.128"] == 2


def test_a_load_used_at_once_has_nothing_else_in_flight():
    text = SASS.replace("LDG.E.128 R12, desc[UR4][R10.64+0x10]", "IADD3 R12, R4, 0x1, RZ")
    assert sass.analyse(text, width=16, n_chunks=1)["loop"]["inflight_bytes_per_warp"] == 16 * 32


def test_atomics_semantics_are_read_from_ptx():
    lines = [
        "@%p1 atom.global.gpu.acq_rel.add.u64 %rd1, [%rd2+0], %rd3;",
        "atom.global.add.u64 %rd4, [%rd5], 1;",
        "red.global.relaxed.cta.add.u32 [%rd6], %r1;",
        "bar.sync 0;",
    ]
    ptx = "\n".join(lines)
    assert sass.ptx_sync(ptx) == {
        "atomics": {"atom.add sem=acq_rel scope=gpu": 1, "atom.add sem=relaxed scope=gpu": 1,
                    "red.add sem=relaxed scope=cta": 1},
        "fences": {},
        "barriers": 1,
    }  # fmt: skip


def test_ctas_per_sm():
    assert sass.ctas_per_sm(128, 16, 0) == 1  # 512 threads x 128 registers: the whole register file
    assert sass.ctas_per_sm(64, 16, 0) == 2
    assert sass.ctas_per_sm(32, 4, 0) == 16  # by threads: 2048 / 128
    assert sass.ctas_per_sm(32, 4, 100 * 1024) == 2  # by shared memory


def _static(inner: int, outer: int, rows: int = 64, n_chunks: int = 1) -> dict:
    config = {"rows": rows, "n_chunks": n_chunks, "num_warps": 16, "chunk": 256, "elem": 4, "vec": 4}
    return {"config": config, "loop": {"instructions": inner}, "tile_loop": {"instructions_outside_inner": outer}}


def test_the_model_takes_the_slower_bound_and_caps_at_the_peak():
    kw = dict(direction="load", layout="kv_first", num_layers=32, blocks=1024, segment_bytes=1024, peak_gbps=50.0)
    cheap, dear = _static(10, 10), _static(100, 1000)
    one_cheap, one_dear = model.predict(cheap, num_ctas=1, **kw), model.predict(dear, num_ctas=1, **kw)
    assert one_cheap["bound"] == "round trips" and one_dear["bound"] == "issue"
    assert one_dear["gbps"] < one_cheap["gbps"] < 50.0
    assert model.predict(cheap, num_ctas=32, **kw) == {**model.predict(cheap, num_ctas=32, **kw), "gbps": 50.0,
                                                      "bound": "link", "fraction_of_peak": 1.0}  # fmt: skip
    # 16 blocks of 64 rows each fill 16 tiles: more programs than that do not run.
    few = dict(kw, blocks=16)
    assert model.predict(cheap, num_ctas=32, **few)["programs"] == 16


def test_the_gpu_summary_puts_the_model_beside_each_kernel_case(tmp_path):
    """tools/gpu/summary.py: a transfer stage's kernel rows, each with the model's prediction from the newest static
    report committed beside the results (the run's Triton; sm_90 off a B200)."""
    import json

    from tools.gpu import summary

    row = {**_static(20, 100), "variant": "small-page.kv_first/load/1group/plain", "arch": "sm_90",
           "segment_bytes": 1024, "triton": "3.6.0"}  # fmt: skip
    (tmp_path / "static-aaaa-2026-11-01.json").write_text(json.dumps({"rows": [{**row, "triton": "3.5.0"}]}))
    (tmp_path / "static-bbbb-2026-11-28.json").write_text(json.dumps({"rows": [row]}))
    case = dict(workload="small-page", layout="kv_first", page_bytes=2048, blocks=128, blocks_per_host_block=1,
                skip=0, direction="load", num_layers=32)  # fmt: skip
    doc = {"mode": "gpu", "device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "rows": [
        {**case, "method": "peak", "gbps": 50.0},
        {**case, "method": "triton", "num_ctas": 4, "gbps": 40.0},
        {**case, "method": "memcpy_batch", "gbps": 20.0},
    ]}  # fmt: skip
    fig = summary.model_figures(doc, tmp_path)
    assert fig["static"] == "static-bbbb-2026-11-28.json" and fig["arch"] == "sm_90"
    (only,) = fig["cases"]
    assert only["measured"] == 0.8 and only["method"] == "triton" and only["num_ctas"] == 4
    expect = model.predict(row, direction="load", layout="kv_first", num_layers=32, blocks=128, segment_bytes=1024,
                           num_ctas=4, peak_gbps=50.0)["fraction_of_peak"]  # fmt: skip
    assert only["predicted"] == expect and only["error"] == round(expect - 0.8, 3)
    assert summary.model_figures(doc, tmp_path / "nothing") == {"error": "no static report committed (./dev static)"}

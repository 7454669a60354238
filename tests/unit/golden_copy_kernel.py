"""The copy kernel without the integrity checks (as at commit c8f7726, kernels/copy_blocks.py, with the data path's
changes since: its row indices int32, issue 58): the kernel without checks must compile to the same PTX
(tests/unit/test_kernel_compile.py). A change to the kernel's data path changes both on purpose: update this copy with
it, in the same commit."""

import triton.language as tl


def _copy_blocks_kernel(
    anchor_ptr,  # ELEM*: the segment table's own storage; GPU addresses are element offsets from it
    host_ptr,  # ELEM*: packed host buffer
    table_ptr,  # int64* (groups * n_segs, 5): gpu offset, block stride, length, host stride between sub-blocks,
    # host offset of sub-block 0 in a host row (elements)
    ids_ptr,  # int64*: GPU ids [n_blocks], host ids [n_host]; if MULTI_GROUP also group of each block [n_blocks]
    # and per group (first block, skip, first host id)
    # The scalars are typed int64 and never specialised (see _NOT_SPECIALIZED): one compiled variant serves every
    # value, which the direct launch (triton_offload/fast_launch.py) relies on.
    n_blocks: tl.int64,
    n_host: tl.int64,
    n_segs: tl.int64,  # segments per group
    tiles_per_program: tl.int64,  # ceil(tiles / programs): the last round is partly masked
    skip: tl.int64,  # single group only; MULTI_GROUP reads each group's skip from ids_ptr
    blocks_per_host_block: tl.int64,
    host_row_stride: tl.int64,  # elements between host blocks
    n_chunks: tl.int64,  # CHUNK-sized steps of the longest segment; shorter ones are masked
    STORE: tl.constexpr,  # True: GPU -> host (a store, gather_blocks); False: host -> GPU (a load, scatter_blocks)
    MULTI_GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    VEC: tl.constexpr,  # every offset and length is a multiple of VEC elements: enables 16-byte accesses
):
    """Moves every (GPU block, segment) item of one transfer; a program walks tiles ``pid, pid + nprog, ...``.

    Position rule (docs/design.md, "The packed host format"): GPU block ``i`` of a group lands at position
    ``p = skip + i``, i.e. host block ``host_ids[first_host + p // blocks_per_host_block]``, sub-block
    ``p % blocks_per_host_block``; segment ``s`` of sub-block ``j`` starts at ``j * host stride + host offset``
    from its table row (the packed format: the stride is the packed sub-block).
    """
    # The row indices (item, block, segment, position, host index) are int32: the planner refuses a transfer of
    # 2**31 rows or more (plan.MAX_ROWS), and 32-bit division and registers are what small pages' tiles spend most on
    # (docs/compiler.md). Addresses and offsets in elements stay int64.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    n_segs32 = n_segs.to(tl.int32)
    f32 = blocks_per_host_block.to(tl.int32)
    n_items = (n_blocks * n_segs).to(tl.int32)
    # A fixed trip count rather than range(pid, n_tiles, nprog): older Triton interpreters cannot take a program id
    # as a Python range bound, and a round past the last tile is simply all masked.
    for i in range(0, tiles_per_program):
        tile = (pid + i * nprog).to(tl.int32)  # i is int64 compiled (its bound is), a Python int interpreted
        item = tile * ROWS + rows  # [ROWS]
        live = item < n_items  # [ROWS]
        blk = item // n_segs32
        seg = item - blk * n_segs32
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        if MULTI_GROUP:
            group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0).to(tl.int32)
            group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
            first_block = tl.load(group_row, mask=live, other=0).to(tl.int32)
            pos = blk - first_block + tl.load(group_row + 1, mask=live, other=0).to(tl.int32)
            host_idx = tl.load(group_row + 2, mask=live, other=0).to(tl.int32) + pos // f32
            seg_row = table_ptr + (group * n_segs32 + seg) * 5
        else:
            pos = blk + skip.to(tl.int32)
            host_idx = pos // f32
            seg_row = table_ptr + seg * 5
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        seg_base = tl.load(seg_row, mask=live, other=0)
        seg_stride = tl.load(seg_row + 1, mask=live, other=0)
        seg_len = tl.load(seg_row + 2, mask=live, other=0)  # dead rows and padding get length 0: fully masked
        seg_host_stride = tl.load(seg_row + 3, mask=live, other=0)
        seg_host = tl.load(seg_row + 4, mask=live, other=0)
        gpu_off = tl.multiple_of(seg_base + gpu_id * seg_stride, VEC)  # [ROWS], elements from the anchor
        host_off = tl.multiple_of(  # [ROWS], elements from the host buffer's start
            host_id * host_row_stride + (pos % f32).to(tl.int64) * seg_host_stride + seg_host, VEC
        )
        seg_len = tl.multiple_of(seg_len.to(tl.int32), VEC)  # a segment is < 2**31 elements (the planner checks)
        for k in range(0, n_chunks):
            col = k * CHUNK + cols  # [CHUNK]
            mask = col[None, :] < seg_len[:, None]  # [ROWS, CHUNK]
            if STORE:
                vals = tl.load(anchor_ptr + gpu_off[:, None] + col[None, :], mask=mask)  # [ROWS, CHUNK]
                tl.store(host_ptr + host_off[:, None] + col[None, :], vals, mask=mask)
            else:
                vals = tl.load(host_ptr + host_off[:, None] + col[None, :], mask=mask)
                tl.store(anchor_ptr + gpu_off[:, None] + col[None, :], vals, mask=mask)

"""Host memory for the packed host cache: its size (:mod:`.budget`), the buffer (:mod:`.cache`), its NUMA placement
(:mod:`.numa`, :mod:`.placement`), huge pages and pinning at allocation (:mod:`.pages`), and CUDA registration
(:mod:`.registration`). Nothing is imported here: the scheduler's configuration parser imports the stdlib-only
modules (:mod:`.budget`, :mod:`.numa`, :mod:`.pages`) without torch.
"""

"""A stand-in for SGLang with the shape of the names engine_patches/sglang relies on (tests only).

It is put on sys.path only by the tests that use it; test_sglang_contract.py checks that its files
satisfy the same CONTRACT entries as SGLang's real source, so the hook tests run against that shape.
"""

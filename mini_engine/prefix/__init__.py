"""Prefix caches beside the hashed blocks of paging.py (chapter 08): `radix_cache.RadixBlockManager`, SGLang's radix
tree, which `LLM(prefix_cache="radix")` plugs in as its block manager; and `policies.HoldAndAgePolicy`, the
cache-aware admission order with in-batch prefix holding and aging (`prefix_holding=`, `aging_s=`)."""

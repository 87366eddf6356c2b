"""``kvstrata simulate``: replay recorded or generated traffic through the store's own placement
policy (``kvstrata.store.policy``, ``index``, ``lru``) over virtual tiers that hold sizes, not
bytes, to plan capacity. See ``docs/simulate.md``."""

"""Development tooling that measures nothing itself (not installed; run from the repository root)."""

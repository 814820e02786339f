"""Device side: pure functions over parameter pytrees (no engine state)."""

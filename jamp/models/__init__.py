"""Models written once, dtype-agnostic, for jamp's precision policies."""

"""codraft."""

"""Model definition and checkpoint loading."""

"""ALFWorld on its real engine (the `alfworld` and `textworld` packages): see docs/ALFWORLD.md."""

"""serl's benchmarks: each script prints a table and writes JSON under benchmarks/results/."""

"""serl's benchmarks: ``python -m benchmarks`` runs the suite (one table, one JSON); each
script also runs alone, prints its table and writes JSON under benchmarks/results/."""

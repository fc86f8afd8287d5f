"""Tools around the core flow: the paper evaluation (bench), the dashboard, the ClassBench importer."""

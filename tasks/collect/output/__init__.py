"""What the collect stage holds and writes: `spool` (the kept documents on disk while the
corpus-level steps run), `spill` (those steps' arrays in files), `mixing` (sources to token
budgets), `funnel` (every record's fate, counted, with review samples) and `gates` (limits on
what the stage removed, checked after it)."""

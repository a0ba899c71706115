"""The long-context study: its runs (jobs), their queue (runner) and the report."""

"""Jobs: what a job is (its spec, schema, states and class), and every query that reads or writes one."""

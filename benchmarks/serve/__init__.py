"""``pdserve bench serve`` / ``bench ab``: a load generator for any OpenAI-compatible server, recipes
that start pdserve deployments, reports (JSON, markdown, PNG) and an accuracy mode. docs/BENCHMARKS.md."""

"""Dev tooling, apart from the product: the local Kafka + PostgreSQL stack, the sample producer and
the demo. The product code never imports it; only the CLI's dev commands (stack, produce, demo) do.
"""

"""The edge's engine adapters: one module per engine family, the upstream HTTP client, answer assembly."""

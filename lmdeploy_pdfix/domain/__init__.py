"""The rules, as plain modules: owner ids, the proxy's ledger, the node's book of preserved caches, cache tickets,
chunk progress, KV layouts, what crosses the wire. Nothing here patches, or imports LMDeploy or an HTTP stack."""

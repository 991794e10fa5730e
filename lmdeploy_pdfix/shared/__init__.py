"""What two or more units use: the node client, route swapping, the node's book and routes, the proxy's books,
the Prometheus collectors. Imports LMDeploy, FastAPI or aiohttp where it must, never a unit."""

"""`ucp demo`: a small sharded training run that saves, reshards and resumes through ucp_store.dist."""

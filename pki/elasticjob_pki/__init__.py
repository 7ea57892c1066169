"""X.509 certificates, built one way for the operator's etcds and the devcluster's
cluster. Imports none of the project's other packages, so both may import it."""

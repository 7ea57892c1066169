"""The ElasticJob operator (kopf). Never imports torch."""

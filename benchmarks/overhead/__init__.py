"""What batchproxy itself costs: per call on an identity model (`overhead`), against
an earlier commit (`ab`), and watching for disconnected clients (`disconnect`)."""

// The digits example end to end (being written).

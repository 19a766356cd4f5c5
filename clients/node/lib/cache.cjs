'use strict';
/*
 * The optional in-process cache of finished HTTP results (the cache option),
 * so that a replay is answered without a database round trip.  An entry is
 * served only for the same fingerprint and until its stored result expires;
 * the HTTP engine decides what goes in.
 */

/* a bounded LRU of finished results, keyed by scope and key */
function createCache(max) {
	const entries = new Map();
	return {
		get(id, fingerprint) {
			const entry = entries.get(id);
			if (entry === undefined)
				return null;
			if (entry.expiresMs <= Date.now()) {
				entries.delete(id);
				return null;
			}
			if (entry.fingerprint !== fingerprint)
				return null;
			entries.delete(id);
			entries.set(id, entry);
			return entry.response;
		},
		set(id, fingerprint, response, expiresMs) {
			if (!(expiresMs > Date.now()))
				return;
			entries.delete(id);
			entries.set(id, { fingerprint, response, expiresMs });
			while (entries.size > max)
				entries.delete(entries.keys().next().value);
		},
		get size() { return entries.size; },
	};
}

module.exports = { createCache };

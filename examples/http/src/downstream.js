'use strict';
/*
 * downstream.js: a mock payment processor, the "external side effect" of
 * POST /payments.  It does what a real processor's idempotency support does,
 * and what any downstream of an at-least-once caller must do:
 *
 *   - dedupe by Idempotency-Key: the first request with a key charges, every
 *     later one gets the same charge back (200, "Idempotent-Replayed: true");
 *   - fencing: it remembers the largest Fencing-Token seen per key and refuses
 *     a request with a smaller one (409 stale-fencing-token), so a slow attempt
 *     that lost its claim cannot act after the attempt that replaced it.
 *
 * State is in memory.  Hooks for tests: failNext(key, status) makes the next
 * request with that key fail before charging; hold(key, when) parks the next
 * request with that key 'before' or 'after' charging until release() is called.
 *
 * Run on its own: PORT=4000 node src/downstream.js
 */

const http = require('node:http');

const DECLINE_ABOVE = 1000000;     /* amounts above this are declined (402) */

function createDownstream() {
	const charges = new Map();     /* key -> { id, amount, currency } */
	const tokens = new Map();      /* key -> largest fencing token seen */
	const requests = [];           /* every request: { key, token, outcome } */
	const failures = new Map();    /* key -> status to answer once */
	const holds = new Map();       /* key -> { when, arrived, resolveArrived, released, release } */
	let nextId = 1;

	function send(res, status, body, headers = {}) {
		res.writeHead(status, {
			'content-type': status >= 400 ? 'application/problem+json' : 'application/json',
			...headers,
		});
		res.end(JSON.stringify(body));
	}

	function parseKey(raw) {
		if (!raw)
			return null;
		try {
			return raw.startsWith('"') ? JSON.parse(raw) : raw;
		} catch {
			return null;
		}
	}

	async function handleCharge(req, res, body) {
		const key = parseKey(req.headers['idempotency-key']);
		const token = /^\d+$/.test(req.headers['fencing-token'] ?? '')
			? BigInt(req.headers['fencing-token']) : null;
		if (key === null || token === null)
			return send(res, 400, { title: 'Idempotency-Key and Fencing-Token required', status: 400 });

		const hold = holds.get(key);
		if (hold) {
			holds.delete(key);
			hold.resolveArrived();
			if (hold.when === 'before')
				await hold.released;
		}

		const record = (outcome) => requests.push({ key, token, outcome });
		const seen = tokens.get(key);
		if (seen !== undefined && token < seen) {
			record('stale');
			return send(res, 409, {
				type: 'https://processor.example/problems/stale-fencing-token',
				title: 'Stale fencing token', status: 409,
				detail: `token ${token} is older than ${seen} for this key`,
			});
		}
		tokens.set(key, token);

		const failure = failures.get(key);
		if (failure !== undefined) {
			failures.delete(key);
			record(`failed ${failure}`);
			return send(res, failure, { title: 'Processor failure', status: failure });
		}

		let status = 201;
		let headers = {};
		let charge = charges.get(key);
		if (charge) {
			record('deduplicated');
			status = 200;
			headers = { 'idempotent-replayed': 'true' };
		} else if (body.amount > DECLINE_ABOVE) {
			record('declined');
			return send(res, 402, {
				title: 'Card declined', status: 402,
				detail: `amounts above ${DECLINE_ABOVE} are declined`,
			});
		} else {
			charge = { id: `ch_${nextId++}`, amount: body.amount, currency: body.currency };
			charges.set(key, charge);
			record('charged');
		}

		if (hold && hold.when === 'after')
			await hold.released;
		return send(res, status, charge, headers);
	}

	const server = http.createServer((req, res) => {
		const chunks = [];
		req.on('data', (c) => chunks.push(c));
		req.on('end', () => {
			if (req.method !== 'POST' || req.url !== '/charges')
				return send(res, 404, { title: 'Not found', status: 404 });
			let body;
			try {
				body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
			} catch {
				return send(res, 400, { title: 'Invalid JSON', status: 400 });
			}
			handleCharge(req, res, body).catch((err) => {
				console.error(err);
				send(res, 500, { title: 'Internal error', status: 500 });
			});
		});
	});

	return {
		server,
		charges,
		requests,
		/* the processor's key for a service key (the service prefixes the scope) */
		keyFor(key, scope = '') {
			return `${encodeURIComponent(scope)}:${encodeURIComponent(key)}`;
		},
		failNext(key, status) {
			failures.set(key, status);
		},
		/* park the next request for key; returns { arrived: Promise, release() } */
		hold(key, when) {
			let resolveArrived;
			let release;
			const arrived = new Promise((r) => { resolveArrived = r; });
			const released = new Promise((r) => { release = r; });
			holds.set(key, { when, resolveArrived, released });
			return { arrived, release };
		},
		requestsFor(key) {
			return requests.filter((r) => r.key === key);
		},
		chargeCount(key) {
			return requests.filter((r) => r.key === key && r.outcome === 'charged').length;
		},
		listen(port = 0) {
			return new Promise((resolve) => {
				server.listen(port, '127.0.0.1', () => {
					resolve(`http://127.0.0.1:${server.address().port}`);
				});
			});
		},
		close() {
			server.closeAllConnections();
			return new Promise((resolve) => server.close(resolve));
		},
	};
}

module.exports = { createDownstream };

if (require.main === module) {
	const downstream = createDownstream();
	downstream.listen(Number(process.env.PORT ?? 4000)).then((url) => {
		console.log(`mock payment processor listening on ${url}`);
	});
}

'use strict';
/*
 * provider.js: a fake payment provider with a ledger, the side effect of
 * POST /orders.  An order is charged in two steps, each an HTTP call:
 *
 *   POST /authorizations  { amount, currency }   -> { id: 'auth_1', ... }
 *   POST /captures        { authorization, amount } -> { id: 'cap_1', ... }
 *
 * It does what a real provider's idempotency support does: a request whose
 * Idempotency-Key it has seen gets the first answer back and is not booked
 * again, and it keeps the largest Fencing-Token seen per order (the key
 * without its step) and refuses a smaller one (409), so that an attempt that
 * lost its key cannot act after the one that took over.  Every request is
 * in the ledger, with what it did: the tests read it to show that each step
 * happened exactly once.
 *
 * Run on its own: PORT=4000 node src/provider.js
 */

const http = require('node:http');

function createProvider() {
	const answers = new Map();      /* idempotency key -> the first answer */
	const tokens = new Map();       /* order -> largest fencing token seen */
	const ledger = [];              /* { step, key, order, token, outcome, id } */
	const next = { authorizations: 1, captures: 1 };

	function send(res, status, body) {
		res.writeHead(status, { 'content-type': status >= 400 ? 'application/problem+json' : 'application/json' });
		res.end(JSON.stringify(body));
	}

	function handle(step, req, res, body) {
		const key = req.headers['idempotency-key'];
		const token = /^\d+$/.test(req.headers['fencing-token'] ?? '') ? BigInt(req.headers['fencing-token']) : null;
		if (!key || token === null)
			return send(res, 400, { title: 'Idempotency-Key and Fencing-Token required', status: 400 });
		/* the order is the key without its step: both steps of one order share a fencing history */
		const order = key.replace(/\/[^/]*$/, '');
		const entry = { step, key, order, token: String(token) };
		const seen = tokens.get(order);
		if (seen !== undefined && token < seen) {
			ledger.push({ ...entry, outcome: 'refused: stale token' });
			return send(res, 409, { title: 'Stale fencing token', status: 409, detail: `${token} < ${seen}` });
		}
		tokens.set(order, token);
		const before = answers.get(key);
		if (before) {
			ledger.push({ ...entry, outcome: 'replayed', id: before.id });
			return send(res, 200, before);
		}
		const prefix = step === 'authorizations' ? 'auth' : 'cap';
		const answer = { id: `${prefix}_${next[step]++}`, ...body };
		answers.set(key, answer);
		ledger.push({ ...entry, outcome: 'booked', id: answer.id });
		return send(res, 201, answer);
	}

	const server = http.createServer((req, res) => {
		const chunks = [];
		req.on('data', (c) => chunks.push(c));
		req.on('end', () => {
			const step = req.method === 'POST' && /^\/(authorizations|captures)$/.exec(req.url)?.[1];
			if (!step)
				return send(res, 404, { title: 'Not found', status: 404 });
			let body;
			try {
				body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
			} catch {
				return send(res, 400, { title: 'Invalid JSON', status: 400 });
			}
			return handle(step, req, res, body);
		});
	});

	return {
		ledger,
		/* what the ledger booked for an order, step by step */
		booked(order) {
			return ledger.filter((e) => e.order === order && e.outcome === 'booked');
		},
		listen(port = 0) {
			return new Promise((resolve) => {
				server.listen(port, '127.0.0.1', () => resolve(`http://127.0.0.1:${server.address().port}`));
			});
		},
		close() {
			server.closeAllConnections();
			return new Promise((resolve) => server.close(resolve));
		},
	};
}

module.exports = { createProvider };

if (require.main === module) {
	createProvider().listen(Number(process.env.PORT ?? 4000)).then((url) => {
		console.log(`fake payment provider listening on ${url}`);
	});
}

'use strict';
/*
 * app.js: the orders service.  POST /orders places an order at the payment
 * provider in two steps (orders.js) under the Idempotency-Key header.  The
 * claim keeps the request with the key (keepRequest), so that if this
 * process dies between the steps, the completer (completer.js) finishes the
 * order from its checkpoint, and the client's retry gets the stored order
 * instead of waiting for a lease and running the rest itself.
 */

const express = require('express');
const { expressIdempotency, rawBody } = require('pg-idempotency');
const { placeOrder, validateOrder } = require('./orders');

/* the scope of the orders' keys: the completer takes over this scope's abandoned keys */
const SCOPE = 'orders';

/*
 * createApp({ pool, providerUrl, lease, afterCheckpoint })
 *   lease: seconds (the middleware's option)
 *   afterCheckpoint(phase): what runs right after a checkpoint (the tests' crash point)
 */
function createApp({ pool, providerUrl, lease, afterCheckpoint, log }) {
	const app = express();
	app.disable('x-powered-by');
	app.use(express.json({ verify: rawBody }));
	const idem = expressIdempotency({ pool, scope: () => SCOPE, keepRequest: true, lease, log });

	/* a malformed order gets its 400 before the middleware: the key stays unused */
	const validate = (req, res, next) => {
		const problem = validateOrder(req.body);
		if (problem === null)
			return next();
		return res.status(400).type('application/problem+json')
			.send(JSON.stringify({ title: 'Invalid order', status: 400, detail: problem }));
	};

	app.post('/orders', validate, idem, async (req, res) => {
		const order = await placeOrder(req.idempotency, req.body, { providerUrl, afterCheckpoint });
		res.status(201).json(order);
	});

	app.get('/healthz', (req, res) => res.json({ ok: true }));
	return app;
}

module.exports = { createApp, SCOPE };

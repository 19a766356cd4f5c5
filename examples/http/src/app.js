'use strict';
/*
 * app.js: a small payments service that uses the Idempotency-Key middleware.
 *
 *   POST /payments  external-call mode: charges a card at a payment processor
 *                   (the mock in downstream.js) over HTTP.  The key and the
 *                   fencing token travel to the processor, which dedupes by key
 *                   and refuses a token smaller than one it has seen.
 *   POST /orders    in-transaction mode: the order row is written in the same
 *                   transaction as the claim and the finish.
 *   GET  /healthz   liveness.
 *
 * Validation runs before the idempotency middleware, so a malformed request
 * gets its 400 without using up the key (the client fixes the body and sends
 * it again with the same key).
 */

const express = require('express');
const { createIdempotency, captureRawBody, HttpProblem } = require('./idempotency');

const PROBLEMS = 'https://payments.example/problems/';

/* RFC 9457 problem details for the service's own errors */
function problemBody(status, type, title, detail) {
	return { type: PROBLEMS + type, title, status, detail };
}

function badRequest(res, detail) {
	res.status(400).type('application/problem+json')
		.send(JSON.stringify(problemBody(400, 'invalid-request', 'Invalid request', detail)));
}

function validatePayment(req, res, next) {
	const b = req.body;
	if (!b || !Number.isInteger(b.amount) || b.amount <= 0)
		return badRequest(res, '"amount" must be a positive integer (minor units).');
	if (typeof b.currency !== 'string' || !/^[A-Z]{3}$/.test(b.currency))
		return badRequest(res, '"currency" must be an ISO 4217 code such as "EUR".');
	return next();
}

function validateOrder(req, res, next) {
	const b = req.body;
	if (!b || typeof b.item !== 'string' || b.item.length === 0)
		return badRequest(res, '"item" must be a non-empty string.');
	if (!Number.isInteger(b.quantity) || b.quantity <= 0)
		return badRequest(res, '"quantity" must be a positive integer.');
	return next();
}

/*
 * createApp({ pool, downstreamUrl, leaseMs, faults })
 *   faults: honour the X-Simulate-Failure request header (for the tests only)
 */
function createApp({ pool, downstreamUrl, leaseMs, retention, faults = false, log }) {
	const app = express();
	app.disable('x-powered-by');
	app.use(express.json({ verify: captureRawBody }));

	const idem = createIdempotency({
		pool,
		leaseMs,
		retention,
		log,
		/* tenants: the same key from two clients names two operations */
		scope: (req) => req.get('X-Client-Id') ?? '',
		problemTypeBase: PROBLEMS,
	});

	app.get('/healthz', (req, res) => res.json({ ok: true }));

	/* (a) external call: at least once towards the processor, deduped there */
	app.post('/payments', validatePayment, idem.external(async (req, ctx) => {
		let answer;
		try {
			answer = await fetch(`${downstreamUrl}/charges`, {
				method: 'POST',
				headers: {
					'content-type': 'application/json',
					/* the processor's key namespace is ours: prefix the tenant */
					'idempotency-key': JSON.stringify(
						`${encodeURIComponent(ctx.scope)}:${encodeURIComponent(ctx.key)}`),
					'fencing-token': String(ctx.token),
				},
				body: JSON.stringify({ amount: req.body.amount, currency: req.body.currency }),
			});
		} catch (err) {
			/* no answer: we do not know whether it charged; the retry asks again */
			throw new HttpProblem(502, 'processor-unreachable', 'Payment processor unreachable',
				'The payment processor did not answer. Retry with the same Idempotency-Key.');
		}
		const charge = await answer.json().catch(() => ({}));
		if (answer.status === 409 && charge.type?.endsWith('/stale-fencing-token'))
			throw new HttpProblem(409, 'stale-attempt', 'Attempt superseded',
				'A newer attempt for this Idempotency-Key reached the processor first.');
		if (answer.status >= 500)
			return {
				status: 502, body: problemBody(502, 'processor-unavailable',
					'Payment processor unavailable',
					'The payment processor failed. Retry with the same Idempotency-Key.'),
			};
		if (answer.status >= 400)
			return {
				status: 402, body: problemBody(402, 'payment-declined', 'Payment declined',
					charge.detail ?? `The processor declined the charge (${answer.status}).`),
			};
		return {
			status: 201,
			body: {
				payment: `pay_${charge.id}`,
				charge: charge.id,
				amount: charge.amount,
				currency: charge.currency,
				status: 'succeeded',
			},
		};
	}));

	/* (b) in-transaction: the order row commits with the stored result, or neither */
	app.post('/orders', validateOrder, idem.transactional(async (req, ctx) => {
		const { rows } = await ctx.client.query(
			`INSERT INTO orders (request_key, item, quantity)
			 VALUES ($1, $2, $3)
			 RETURNING id, item, quantity, created_at`,
			[ctx.key, req.body.item, req.body.quantity]);
		if (faults && req.get('X-Simulate-Failure') === 'after-insert')
			throw new Error('simulated failure after the INSERT');
		const order = rows[0];
		return {
			status: 201,
			body: {
				order: Number(order.id), item: order.item, quantity: order.quantity,
				created_at: order.created_at.toISOString(),
			},
		};
	}));

	return app;
}

module.exports = { createApp };

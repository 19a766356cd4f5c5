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
 * The Idempotency-Key handling is the pg-idempotency package's Express
 * middleware (clients/node).  Validation runs before it, so a malformed request
 * gets its 400 without using up the key (the client fixes the body and sends
 * it again with the same key).
 */

const express = require('express');
const { expressIdempotency, rawBody } = require('pg-idempotency');

const PROBLEMS = 'https://payments.example/problems/';

/* RFC 9457 problem details for the service's own errors */
function problemBody(status, type, title, detail) {
	return { type: PROBLEMS + type, title, status, detail };
}

function sendProblem(res, status, type, title, detail) {
	res.status(status).type('application/problem+json')
		.send(JSON.stringify(problemBody(status, type, title, detail)));
}

function badRequest(res, detail) {
	sendProblem(res, 400, 'invalid-request', 'Invalid request', detail);
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
 * createApp({ pool, downstreamUrl, lease, retention, faults })
 *   lease, retention: seconds (the middleware's options)
 *   faults: honour the X-Simulate-Failure request header (for the tests only)
 */
function createApp({ pool, downstreamUrl, lease, retention, faults = false, log }) {
	const app = express();
	app.disable('x-powered-by');
	/* the fingerprint hashes the raw body bytes: keep them */
	app.use(express.json({ verify: rawBody }));

	const idem = expressIdempotency({
		pool,
		lease,
		retention,
		log,
		/* tenants: the same key from two clients names two operations */
		scope: (req) => req.get('X-Client-Id') ?? '',
		problemTypeBase: PROBLEMS,
	});

	app.get('/healthz', (req, res) => res.json({ ok: true }));

	/*
	 * (a) external call: at least once towards the processor, deduped there.
	 * A 5xx answer releases the key (the retry charges again, deduped by the
	 * processor); a 4xx answer is stored as failed and replayed.
	 */
	app.post('/payments', validatePayment, idem, async (req, res) => {
		const { key, scope, token } = req.idempotency;
		let answer;
		try {
			answer = await fetch(`${downstreamUrl}/charges`, {
				method: 'POST',
				headers: {
					'content-type': 'application/json',
					/* the processor's key namespace is ours: prefix the tenant */
					'idempotency-key': JSON.stringify(
						`${encodeURIComponent(scope)}:${encodeURIComponent(key)}`),
					'fencing-token': token,
				},
				body: JSON.stringify({ amount: req.body.amount, currency: req.body.currency }),
			});
		} catch {
			/* no answer: we do not know whether it charged; the retry asks again */
			return sendProblem(res, 502, 'processor-unreachable', 'Payment processor unreachable',
				'The payment processor did not answer. Retry with the same Idempotency-Key.');
		}
		const charge = await answer.json().catch(() => ({}));
		if (answer.status === 409 && charge.type?.endsWith('/stale-fencing-token'))
			return sendProblem(res, 409, 'stale-attempt', 'Attempt superseded',
				'A newer attempt for this Idempotency-Key reached the processor first.');
		if (answer.status >= 500)
			return sendProblem(res, 502, 'processor-unavailable', 'Payment processor unavailable',
				'The payment processor failed. Retry with the same Idempotency-Key.');
		if (answer.status >= 400)
			return sendProblem(res, 402, 'payment-declined', 'Payment declined',
				charge.detail ?? `The processor declined the charge (${answer.status}).`);
		return res.status(201).json({
			payment: `pay_${charge.id}`,
			charge: charge.id,
			amount: charge.amount,
			currency: charge.currency,
			status: 'succeeded',
		});
	});

	/* (b) in-transaction: the order row commits with the stored result, or neither */
	app.post('/orders', validateOrder, idem.transactional, async (req, res) => {
		const { key, client } = req.idempotency;
		const { rows } = await client.query(
			`INSERT INTO orders (request_key, item, quantity)
			 VALUES ($1, $2, $3)
			 RETURNING id, item, quantity, created_at`,
			[key, req.body.item, req.body.quantity]);
		if (faults && req.get('X-Simulate-Failure') === 'after-insert')
			throw new Error('simulated failure after the INSERT');
		const order = rows[0];
		return res.status(201).json({
			order: Number(order.id), item: order.item, quantity: order.quantity,
			created_at: order.created_at.toISOString(),
		});
	});

	/* a thrown error: a 500 problem, which releases the key (or rolls the transaction back) */
	app.use((err, req, res, next) => {
		if (res.headersSent)
			return next(err);
		(log ?? console.error)('request failed', err);
		return sendProblem(res, 500, 'internal-error', 'Internal server error',
			'The request failed and was not recorded; retry with the same Idempotency-Key.');
	});

	return app;
}

module.exports = { createApp };

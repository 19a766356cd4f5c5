
# Copyright: the idempotency extension authors.
#
# 213_sql_edition_row_locks.pl: the SQL edition's questions about another
# transaction's hold on a key's row, asked of a row version in each state
# another session can leave it in, and a token call after each.
#
# The SQL edition cannot read another transaction's new row version, so a
# finish, extend, release or checkpoint that finds the key's row busy asks
# the row itself, without waiting (_row_hold), and from the answer draws
# two conclusions, checked here as "being_updated|row_locked":
#   being updated  another transaction is updating the version (not
#                  deleting it, not only row-locking it), or the version is
#                  gone (the caller reads again);
#   row locked     another transaction holds any lock on it; NULL when the
#                  version is gone: a change committed since the caller
#                  read it.
# Checked, with a second session holding the row each way in turn:
#   - nobody: neither question says yes;
#   - FOR SHARE held: locked, not being updated;
#   - an update of sweep_at in flight (a sweep's change): both yes;
#   - a delete in flight: locked, not being updated;
#   - that update committed: the version is gone (NULL, and true);
#   - and after all of it the holder's finish with its token goes through
#     and stores its response (a replaced version is read again, not taken
#     for a lock).
# Against the C edition the file skips: it has no such helpers (it reads
# the newest version with a dirty snapshot).
#
# Run it like the other TAP tests (see the top of t/001_restart.pl), with
# IDEM_EDITION=plain or pgtle.  Port 55479 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

plan skip_all => 'C edition: it reads the newest row version with a dirty snapshot '
  . 'and has none of the SQL edition\'s row-lock questions'
  unless sql_edition();

my $node = new_node('rowlocks', port => 55479, extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

my $c = claim($node, 'postgres', "'k', '{\"n\": 1}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'the key is claimed');
my $tid = sql("SELECT ctid FROM idempotency.keys WHERE key = 'k'");

# Both answers about the version at $tid, as "being_updated|row_locked"
# (NULL as "null").
sub questions
{
	return sql(
		    "SELECT concat_ws('|', (h IN ('update', 'gone'))::text, "
		  . "CASE h WHEN 'gone' THEN 'null' ELSE (h <> 'free')::text END) "
		  . "FROM idempotency._row_hold('$tid') AS h");
}

is(questions(), 'false|false', 'nobody holds the row: neither question says yes');

my $b = $node->background_psql('postgres');

$b->query_safe("BEGIN; SELECT FROM idempotency.keys WHERE key = 'k' FOR SHARE");
is(questions(), 'false|true', 'FOR SHARE held: locked, not being updated');
$b->query_safe('ROLLBACK');

$b->query_safe(
	"BEGIN; UPDATE idempotency.keys SET sweep_at = sweep_at + interval '1 second' WHERE key = 'k'");
is(questions(), 'true|true', 'an update of sweep_at in flight: being updated, locked');
$b->query_safe('ROLLBACK');

$b->query_safe("BEGIN; DELETE FROM idempotency.keys WHERE key = 'k'");
is(questions(), 'false|true', 'a delete in flight: locked, not being updated');
$b->query_safe('ROLLBACK');

is(questions(), 'false|false', 'each rolled back: the version is free again');

$b->query_safe(
	"UPDATE idempotency.keys SET sweep_at = sweep_at + interval '1 second' WHERE key = 'k'");
is(questions(), 'true|null',
	'the update committed: the version is gone (being updated: read again; locked: NULL)');
$b->quit;

is(sql("SELECT idempotency.idem_finish('k', $c->{token}, 200, '{\"done\": true}') IS NOT NULL"),
	't', 'the holder finishes the key with its token');
is(sql("SELECT concat_ws('|', status, token, response_code, response_body) "
		  . "FROM idempotency.keys WHERE key = 'k'"),
	"succeeded|$c->{token}|200|{\"done\": true}",
	'the finish is stored: status, token, code, body');

done_testing();
